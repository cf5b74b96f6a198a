// One register_<family>(m) per kernel family; module.cpp calls them all.
#pragma once

#include <pybind11/eval.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace zi::bindings {

void register_sparse_mla(pybind11::module_& m);
void register_moe_gemm(pybind11::module_& m);
void register_dispatch_combine(pybind11::module_& m);
void register_length_correction(pybind11::module_& m);
void register_mhc(pybind11::module_& m);
void register_rope(pybind11::module_& m);
void register_indexer(pybind11::module_& m);
void register_rms_norm(pybind11::module_& m);
void register_moe_route(pybind11::module_& m);

// Pointers cross the boundary as Python ints (tensor.data_ptr()); 0 means "absent".
template <typename T>
inline T* as_ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// ---- exceptions never cross the pybind11 boundary -------------------------------------------
// Every binding is registered with zi::bindings::def(m, name, f, extra...) instead of m.def.
// The C++ callable runs inside a try/catch in _C's own frame; an exception becomes a Python
// exception OBJECT that the binding returns as a value (no C++ throw unwinds through pybind11's
// dispatcher or its exception translators), and a two-line Python wrapper installed under the
// public name raises it. Mapping (same as pybind11's): invalid_argument / domain_error /
// length_error / range_error -> ValueError, out_of_range -> IndexError, overflow_error ->
// OverflowError, bad_alloc -> MemoryError, error_already_set -> the Python error itself,
// pybind11::builtin_exception (py::value_error, ...) -> its own Python type, any
// other std::exception or unknown throw -> RuntimeError. Background: README "Known issues"
// (the H200 image segfaulted on any exception leaving _C through pybind11).
namespace detail {

inline pybind11::object fetch_error();

inline pybind11::object exception_object(PyObject* type, const char* msg) {
  PyObject* text = PyUnicode_DecodeUTF8(msg, static_cast<Py_ssize_t>(std::strlen(msg)), "replace");
  PyObject* exc = text ? PyObject_CallOneArg(type, text) : nullptr;
  Py_XDECREF(text);
  if (exc) return pybind11::reinterpret_steal<pybind11::object>(exc);
  return fetch_error();  // building it failed (e.g. out of memory): whatever Python raised
}

// The pending Python error as an exception object (cleared), or MemoryError if none.
inline pybind11::object fetch_error() {
  PyObject *t = nullptr, *v = nullptr, *tb = nullptr;
  PyErr_Fetch(&t, &v, &tb);
  PyErr_NormalizeException(&t, &v, &tb);
  if (v && tb) PyException_SetTraceback(v, tb);
  Py_XDECREF(t);
  Py_XDECREF(tb);
  if (v) return pybind11::reinterpret_steal<pybind11::object>(v);
  return pybind11::reinterpret_steal<pybind11::object>(PyObject_CallNoArgs(PyExc_MemoryError));
}

template <typename R, typename F, typename... A>
auto guard_impl(F f) {
  return [f = std::move(f)](A... a) -> pybind11::object {
    try {
      if constexpr (std::is_void_v<R>) {
        f(std::forward<A>(a)...);
        return pybind11::none();
      } else if constexpr (std::is_base_of_v<pybind11::object, R>) {
        return pybind11::object(f(std::forward<A>(a)...));  // py::tuple, typing::Tuple, ...
      } else {
        return pybind11::cast(f(std::forward<A>(a)...));
      }
    } catch (pybind11::error_already_set& e) {
      return e.value();
    } catch (const pybind11::builtin_exception& e) {  // py::value_error etc.: their own type
      e.set_error();
      return fetch_error();
    } catch (const std::bad_alloc& e) {
      return exception_object(PyExc_MemoryError, e.what());
    } catch (const std::out_of_range& e) {
      return exception_object(PyExc_IndexError, e.what());
    } catch (const std::overflow_error& e) {
      return exception_object(PyExc_OverflowError, e.what());
    } catch (const std::invalid_argument& e) {
      return exception_object(PyExc_ValueError, e.what());
    } catch (const std::domain_error& e) {
      return exception_object(PyExc_ValueError, e.what());
    } catch (const std::length_error& e) {
      return exception_object(PyExc_ValueError, e.what());
    } catch (const std::range_error& e) {
      return exception_object(PyExc_ValueError, e.what());
    } catch (const std::exception& e) {
      return exception_object(PyExc_RuntimeError, e.what());
    } catch (...) {
      return exception_object(PyExc_RuntimeError, "zeroinfer._C: unknown C++ exception");
    }
  };
}

template <typename T>
struct callable_traits : callable_traits<decltype(&T::operator())> {};
template <typename R, typename... A>
struct callable_traits<R (*)(A...)> {
  template <typename F>
  static auto guard(F f) { return guard_impl<R, F, A...>(std::move(f)); }
};
template <typename C, typename R, typename... A>
struct callable_traits<R (C::*)(A...) const> : callable_traits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct callable_traits<R (C::*)(A...)> : callable_traits<R (*)(A...)> {};

// The Python side: def raising(fn) -> a function that calls fn and raises a returned exception.
// Created once per process (leaked on purpose: no Python object destroyed after finalization).
inline pybind11::object raising_wrapper() {
  static pybind11::object* wrapper = [] {
    pybind11::dict scope;
    scope["__builtins__"] = pybind11::module_::import("builtins");
    pybind11::exec(R"(
import functools
def raising(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        r = fn(*args, **kwargs)
        if isinstance(r, BaseException):
            raise r
        return r
    return call
)", scope);
    return new pybind11::object(scope["raising"]);
  }();
  return *wrapper;
}

}  // namespace detail

// The callable wrapped so that it never throws: see above.
template <typename F>
auto guarded(F f) {
  using D = std::decay_t<F>;
  if constexpr (std::is_function_v<std::remove_pointer_t<D>>) {
    return detail::callable_traits<D>::guard(D(f));
  } else {
    return detail::callable_traits<D>::guard(std::move(f));
  }
}

// m.def(name, f, extra...) with f guarded and the public name bound to the raising wrapper;
// the name is listed in _C._GUARDED (tests check that every public function is). One overload
// per name (a second def of the same name would not become a pybind11 sibling).
template <typename F, typename... Extra>
void def(pybind11::module_& m, const char* name, F&& f, const Extra&... extra) {
  m.def(name, guarded(std::forward<F>(f)), extra...);
  m.attr(name) = detail::raising_wrapper()(m.attr(name));
  if (!pybind11::hasattr(m, "_GUARDED")) m.attr("_GUARDED") = pybind11::list();
  m.attr("_GUARDED").cast<pybind11::list>().append(name);
}

}  // namespace zi::bindings
