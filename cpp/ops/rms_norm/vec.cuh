// Moved to ops/common/vec.cuh (shared by several ops); kept so existing includes keep working.
#pragma once
#include "ops/common/vec.cuh"
