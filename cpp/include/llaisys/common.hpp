// Errors and checks shared by the whole core. Each exception type maps to one Python exception in the
// bindings: TypeError, ValueError (std::invalid_argument), IndexError (std::out_of_range),
// MemoryError (OutOfMemoryError), RuntimeError (everything else).
#pragma once
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace llaisys {

struct TypeError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};
struct OutOfMemoryError : std::runtime_error {
    using std::runtime_error::runtime_error;
};
// Raised when something needs a backend this build does not contain.
struct NotCompiledError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

namespace detail {
// Error messages are built with std::string and to_string/snprintf, never iostreams: on a GPU image an
// integer streamed into an ostringstream crashed inside libstdc++ once torch was loaded in the process
// (two C++ runtimes meeting in _M_insert<long>); plain string building has no locale machinery to clash.
inline void append(std::string &s, const std::string &v) { s += v; }
inline void append(std::string &s, const char *v) { s += v ? v : "(null)"; }
inline void append(std::string &s, char v) { s += v; }
inline void append(std::string &s, bool v) { s += v ? "true" : "false"; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void append(std::string &s, T v) {
    if constexpr (std::is_floating_point_v<T>) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%g", double(v));
        s += buf;
    } else {
        s += std::to_string(v);
    }
}

template <typename... Args>
std::string concat(const Args &...args) {
    std::string s;
    (append(s, args), ...);
    return s;
}
} // namespace detail

} // namespace llaisys

// LLAISYS_CHECK(cond, ExceptionType, message parts...): throw ExceptionType(message) unless cond.
#define LLAISYS_CHECK(cond, Exc, ...)                                                                  \
    do {                                                                                               \
        if (!(cond)) throw Exc(::llaisys::detail::concat(__VA_ARGS__));                                \
    } while (0)
