// Shared by the binding files: each bind_* adds its part of the `llaisys._core` module.
#pragma once
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void bind_runtime(nb::module_ &m);
void bind_tensor(nb::module_ &m);
void bind_ops(nb::module_ &m);
void bind_model(nb::module_ &m);
void bind_serving(nb::module_ &m);
