// The llaisys._core extension: error translation, build info, memory, streams and events.
#include "bindings/common.hpp"
#include "llaisys/comm.hpp"
#include "llaisys/common.hpp"
#include "llaisys/graph.hpp"
#include "llaisys/memory.hpp"
#include "llaisys/stream.hpp"
#include "llaisys/thread_pool.hpp"

#include <nanobind/stl/string.h>

#include <cstdint>

using namespace llaisys;

void bind_quant(nb::module_ &m); // bindings/quant.cpp

static nb::dict build_info() {
    nb::dict d;
    d["version"] = LLAISYS_VERSION;
    d["cuda"] = cuda_compiled();
#ifdef LLAISYS_WITH_CUDA
    d["cuda_version"] = LLAISYS_CUDA_VERSION;
    d["cuda_archs"] = LLAISYS_CUDA_ARCHS;
#else
    d["cuda_version"] = nb::none();
    d["cuda_archs"] = nb::none();
#endif
    if (nccl_available()) // tensor parallelism over GPUs (llaisys/comm.hpp)
        d["nccl"] = nccl_version();
    else
        d["nccl"] = nb::none();
    d["compiler"] = LLAISYS_CXX_COMPILER;
    d["cpu_flags"] = LLAISYS_CPU_FLAGS;
    d["cpu_threads"] = cpu_threads();
    return d;
}

static nb::dict stats_dict(const std::string &device) {
    const MemoryStats s = memory_stats(Device::parse(device));
    nb::dict d;
    d["allocated"] = s.allocated;
    d["reserved"] = s.reserved;
    d["peak"] = s.peak_allocated;
    d["device_mallocs"] = s.num_device_mallocs;
    d["device_frees"] = s.num_device_frees;
    return d;
}

static void set_pool_mode_by_name(const std::string &mode, bool restart) {
    if (mode == "adaptive") set_pool_mode(PoolMode::adaptive, restart);
    else if (mode == "serial") set_pool_mode(PoolMode::serial, restart);
    else if (mode == "parallel") set_pool_mode(PoolMode::parallel, restart);
    else throw nb::value_error(("set_pool_mode: mode must be 'adaptive', 'serial' or 'parallel', not '" + mode + "'").c_str());
}

static nb::dict pool_stats_dict() {
    const PoolStats s = pool_stats();
    nb::dict d;
    d["parallel_jobs"] = s.parallel_jobs;
    d["serial_jobs"] = s.serial_jobs;
    d["switches_to_serial"] = s.switches_to_serial;
    d["probes"] = s.probes;
    return d;
}

void bind_runtime(nb::module_ &m) {
    m.def("build_info", &build_info, "What this build of llaisys contains.");
    m.def("set_leak_warnings", [](bool on) { nb::set_leak_warnings(on); }, nb::arg("on"),
          "Whether nanobind lists the instances still alive at exit (off once objects are kept on purpose: "
          "engine/ranks.py's keep_if_left_behind).");
    m.def("set_pool_mode", &set_pool_mode_by_name, nb::arg("mode"), nb::arg("restart") = true,
          "Tests and benchmarks only: the CPU pool's 'adaptive' (default), 'serial' or 'parallel' jobs; "
          "restart=False keeps what the adaptive choice has measured.");
    m.def("pool_stats", &pool_stats_dict,
          "The CPU pool's jobs on the workers / on the caller alone, switches to the caller alone, probes.");
    m.def("cuda_device_count", &cuda_device_count);
    m.def("cuda_device_name", &cuda_device_name, nb::arg("index"), "The product name of CUDA device `index`.");
    m.def("memory_stats", &stats_dict, nb::arg("device"),
          "Bytes allocated, reserved, peak, and the number of device mallocs/frees on `device`.");
    m.def("reset_peak_memory_stats", [](const std::string &d) { reset_peak_memory(Device::parse(d)); },
          nb::arg("device"));
    m.def("empty_cache", [](const std::string &d) { empty_cache(Device::parse(d)); }, nb::arg("device"),
          "Returns cached, unused device memory to the driver.");
    m.def("synchronize", [](const std::string &d) {
        const Device dev = Device::parse(d);
        nb::gil_scoped_release release;
        synchronize(dev);
    }, nb::arg("device"), "Waits for all work on `device`; raises errors reported by kernels.");

    nb::class_<Stream>(m, "Stream")
        .def_prop_ro("device", [](const Stream &s) { return s.device().str(); })
        .def_prop_ro("handle", [](const Stream &s) { return reinterpret_cast<uintptr_t>(s.handle()); })
        .def_prop_ro("capturing", &Stream::capturing, "Whether the stream is being captured into a CUDA graph.")
        .def("synchronize", [](const Stream &s) {
            nb::gil_scoped_release release;
            s.synchronize();
        })
        .def("__eq__", [](const Stream &a, const Stream &b) { return a == b; })
        .def("__repr__", [](const Stream &s) {
            return "Stream(device=" + s.device().str() + ", handle=" + std::to_string(uintptr_t(s.handle())) + ")";
        });
    m.def("current_stream", [](const std::string &d) { return current_stream(Device::parse(d)); }, nb::arg("device"));
    m.def("new_stream", [](const std::string &d) { return new_stream(Device::parse(d)); }, nb::arg("device"));
    m.def("set_current_stream", &set_current_stream, nb::arg("stream"));

    // For tests and benchmarks: the engine's runner captures its own graphs; this lets a test put one op (an
    // all-reduce) into a graph and replay it.
    nb::class_<Graph>(m, "Graph", "A CUDA graph of the work fn enqueues on the device's current stream.")
        .def("__init__", [](Graph *g, const std::string &d) { new (g) Graph(Device::parse(d)); }, nb::arg("device"))
        .def("capture", [](Graph &g, nb::callable fn) { g.capture([&] { fn(); }); }, nb::arg("fn"),
             "Runs fn() once under stream capture (no host syncs inside); its work is not executed then.")
        .def("replay", &Graph::replay, nb::call_guard<nb::gil_scoped_release>(),
             "Enqueues the captured work on the device's current stream (without the GIL: a launch may wait "
             "for the device, whose collectives may wait for another thread's rank).")
        .def_prop_ro("captured", &Graph::captured);

    nb::class_<Event>(m, "Event")
        .def("__init__", [](Event *e, const std::string &d, bool timing) { new (e) Event(Device::parse(d), timing); },
             nb::arg("device"), nb::arg("timing") = false)
        .def("record", &Event::record, nb::arg("stream"))
        .def("wait", &Event::wait, nb::arg("stream"))
        .def("synchronize", [](const Event &e) {
            nb::gil_scoped_release release;
            e.synchronize();
        })
        .def("query", &Event::query)
        .def("elapsed_ms", &Event::elapsed_ms, nb::arg("end"));
}

NB_MODULE(_core, m) {
    m.doc() = "llaisys C++ core";
    nb::register_exception_translator([](const std::exception_ptr &p, void *) {
        try {
            std::rethrow_exception(p);
        } catch (const TypeError &e) {
            PyErr_SetString(PyExc_TypeError, e.what());
        } catch (const OutOfMemoryError &e) {
            PyErr_SetString(PyExc_MemoryError, e.what());
        }
    });
    bind_runtime(m);
    bind_tensor(m);
    bind_ops(m);
    bind_model(m);
    bind_quant(m);
    bind_serving(m);
}
