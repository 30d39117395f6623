#pragma once
// The parts of the _qkv extension module, each adding its functions to it (module.cpp calls them).

#include <pybind11/pybind11.h>

namespace qkv::python {

void add_attention(pybind11::module_& m);       // attention.cpp
void add_self_attention(pybind11::module_& m);  // self_attention.cpp
void add_heatmap(pybind11::module_& m);         // heatmap.cpp
void add_explorer(pybind11::module_& m);        // explorer.cpp
void add_stored(pybind11::module_& m);          // stored.cpp

}  // namespace qkv::python
