// The single pybind11 module elixir._C. Each feature registers itself from its own file.
#include "registry.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "elixir native hot paths (raw buffers, runtime CPU dispatch)";
  elixir::register_cpu_features(m);
  elixir::register_cpu_adam(m);
  elixir::register_cache_sim(m);
  elixir::register_aio(m);
  elixir::register_nf4(m);
}
