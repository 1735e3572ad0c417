#include "bindings/common.hpp"

void bind_model(nb::module_ &m) {}
