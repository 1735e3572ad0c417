// Errors and checks shared by the whole core. Each exception type maps to one Python exception in the
// bindings: TypeError, ValueError (std::invalid_argument), IndexError (std::out_of_range),
// MemoryError (OutOfMemoryError), RuntimeError (everything else).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

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
template <typename... Args>
std::string concat(const Args &...args) {
    std::ostringstream os;
    (os << ... << args);
    return os.str();
}
} // namespace detail

} // namespace llaisys

// LLAISYS_CHECK(cond, ExceptionType, message parts...): throw ExceptionType(message) unless cond.
#define LLAISYS_CHECK(cond, Exc, ...)                                                                  \
    do {                                                                                               \
        if (!(cond)) throw Exc(::llaisys::detail::concat(__VA_ARGS__));                                \
    } while (0)
