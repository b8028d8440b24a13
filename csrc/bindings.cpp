// The fastfeed._C module: thin bindings over csrc/, one register_<topic>() per topic.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "copy.h"
#include "cuda.h"
#include "freelist.h"
#include "numa.h"
#include "segment.h"

namespace py = pybind11;

namespace fastfeed {

void register_lease(py::module_& m);  // lease.cpp

namespace {

void register_errors() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CudaError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const OsError& e) {
      // OSError(errno, msg) picks the subclass itself: FileExistsError, PermissionError, ...
      py::object exc = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_OSError, "is", e.err(), e.what()));
      if (exc) PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
}

void register_segment(py::module_& m) {
  // The GIL is released in create/attach: fallocate and prefault take milliseconds for large
  // segments. Arguments are converted before the guard, and nothing inside touches Python.
  using nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<Segment>(m, "Segment", py::buffer_protocol())
      .def_static("create", &Segment::create, py::arg("name"), py::arg("size"), py::kw_only(),
                  py::arg("numa_node") = -1, py::arg("hugepage") = true, nogil())
      .def_static("attach", &Segment::attach, py::arg("name"), py::kw_only(), py::arg("populate") = true,
                  nogil())
      .def_property_readonly("name", &Segment::name)
      .def_property_readonly("size", &Segment::size)
      .def_property_readonly("address",
                             [](const Segment& s) { return reinterpret_cast<std::uintptr_t>(s.data()); })
      .def_property_readonly("numa_bound", &Segment::numa_bound)
      .def_property_readonly("pinned", &Segment::pinned)
      // Registration takes milliseconds per 10 MB; other threads go on meanwhile.
      .def("pin", &Segment::pin, py::arg("device") = -1, nogil())
      .def("unpin", &Segment::unpin, nogil())
      .def("__len__", &Segment::size)
      .def("__repr__",
           [](const Segment& s) {
             return "<fastfeed._C.Segment name='" + s.name() + "' size=" + std::to_string(s.size()) + ">";
           })
      .def_buffer([](Segment& s) {
        return py::buffer_info(s.data(), 1, "B", 1, {static_cast<py::ssize_t>(s.size())}, {1},
                               /*readonly=*/false);
      });
  m.def("unlink", &unlink_segment, py::arg("name"));
}

void register_cuda(py::module_& m) {
  // Which library to load is policy (fastfeed/_pinning.py): the runtime torch loaded.
  m.def("cuda_load", &cuda::load, py::arg("path"),
        "Load the CUDA runtime at path; returns '' on success, else why not.");
  m.def("cuda_loaded", &cuda::loaded);
}

void register_numa(py::module_& m) {
  // Per thread: a worker process or thread calls these on itself.
  m.def("numa_prefer_node", &numa::prefer_node, py::arg("node"));
  m.def(
      "numa_policy", [](std::uintptr_t address) { return numa::policy(reinterpret_cast<const void*>(address)); },
      py::arg("address") = 0);
}

void register_copy(py::module_& m) {
  // Addresses, not buffers: the caller (layout.fill) holds the tensors alive and has
  // checked that each source is contiguous and that the destination has room.
  m.def(
      "gather",
      [](std::uintptr_t dst, const std::vector<std::pair<std::uintptr_t, std::size_t>>& srcs) {
        py::gil_scoped_release nogil;
        gather(reinterpret_cast<std::uint8_t*>(dst), srcs);
      },
      py::arg("dst"), py::arg("srcs"));
}

void register_freelist(py::module_& m) {
  // Addresses, not buffers: the caller (fastfeed/_ring/control.py) keeps the mapping alive
  // and passes the bitmap's address and its number of 64-bit words.
  m.def(
      "claim_bit",
      [](std::uintptr_t words, std::size_t nwords) {
        return claim_bit(reinterpret_cast<std::uint64_t*>(words), nwords);
      },
      py::arg("words"), py::arg("nwords"));
  m.def(
      "release_bit",
      [](std::uintptr_t words, std::size_t bit) { release_bit(reinterpret_cast<std::uint64_t*>(words), bit); },
      py::arg("words"), py::arg("bit"));
  m.def(
      "add_count",
      [](std::uintptr_t counter, std::uint64_t delta) {
        return add_count(reinterpret_cast<std::uint64_t*>(counter), delta);
      },
      py::arg("counter"), py::arg("delta"));
}

}  // namespace
}  // namespace fastfeed

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastfeed native core: shared-memory segments and leases (mechanisms only).";
  fastfeed::register_errors();
  fastfeed::register_segment(m);
  fastfeed::register_lease(m);
  fastfeed::register_copy(m);
  fastfeed::register_freelist(m);
  fastfeed::register_cuda(m);
  fastfeed::register_numa(m);
}
