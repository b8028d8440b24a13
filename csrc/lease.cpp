// Lease: a buffer exporter over a Segment that calls back when its last consumer is gone.
//
// torch.frombuffer(lease) keeps a reference to the lease (not the Py_buffer) in the tensor's
// storage, and every view, slice or .view(dtype) shares that storage. So the Lease object dies
// exactly when the last tensor over the slot dies; its destructor is the "slot is free" signal.
#include <pybind11/pybind11.h>

#include <memory>
#include <utility>

#include "segment.h"

namespace py = pybind11;

namespace fastfeed {
namespace {

class Lease {
 public:
  Lease(py::object segment, const Segment* seg, py::function on_release)
      : segment_(std::move(segment)), seg_(seg), on_release_(std::move(on_release)) {}

  // Only Python's deallocator destroys a Lease, so the GIL is held here.
  ~Lease() {
    py::object callback = std::move(on_release_);  // moved out: it can run only once
    // Keep any exception already in flight (we may be dying during unwinding).
    py::error_scope in_flight;
    try {
      callback();
    } catch (py::error_already_set& e) {
      // A destructor has no caller to raise to; report the way Python reports __del__ errors.
      e.discard_as_unraisable("fastfeed._C.Lease on_release callback");
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      PyErr_WriteUnraisable(segment_.ptr());
    }
  }

  const py::object& segment() const { return segment_; }
  const Segment& seg() const { return *seg_; }

 private:
  py::object segment_;  // strong reference: the mapping outlives every tensor over the lease
  const Segment* seg_;  // the C++ object behind segment_, kept alive by it
  py::object on_release_;
};

}  // namespace

void register_lease(py::module_& m) {
  py::class_<Lease>(m, "Lease", py::buffer_protocol())
      .def(py::init([](const Segment& seg, py::function on_release) {
             // py::cast of a pointer to a bound instance returns that same Python object.
             return std::make_unique<Lease>(py::cast(&seg), &seg, std::move(on_release));
           }),
           py::arg("segment"), py::arg("on_release"))
      .def_property_readonly("segment", &Lease::segment)
      .def_buffer([](Lease& l) {
        const Segment& s = l.seg();
        return py::buffer_info(s.data(), 1, "B", 1, {static_cast<py::ssize_t>(s.size())}, {1},
                               /*readonly=*/false);
      });
}

}  // namespace fastfeed
