// Python binding (pybind11, Debian's pybind11-dev) of the engine, layouts and connector: the
// module itself; each part binds in its own file (python/py_support.h lists them). Errors
// become RuntimeError (ValueError for invalid arguments) with the status message.
#include <pybind11/pybind11.h>

#include "python/py_support.h"

PYBIND11_MODULE(_kvwire, m) {
  m.doc() = "kvwire: KV-cache transfer engine, layouts and connector";
  kvwire_py::BindLayouts(m);
  kvwire_py::BindEngineOptions(m);
  kvwire_py::BindEngine(m);
  kvwire_py::BindConnectorOptions(m);
  kvwire_py::BindConnector(m);
  kvwire_py::BindSchedulerHalf(m);
}
