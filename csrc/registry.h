// Every csrc/*.cpp file that exposes functions to Python defines one register_* function,
// declared here and called from module.cpp. Files see raw buffers only: no torch headers.
#pragma once
#include <pybind11/pybind11.h>

namespace elixir {
void register_cpu_features(pybind11::module_& m);
void register_cpu_adam(pybind11::module_& m);
void register_cache_sim(pybind11::module_& m);
void register_aio(pybind11::module_& m);
void register_nf4(pybind11::module_& m);
}  // namespace elixir
