// _flashckpt: the pybind11 bridge between the flashckpt Python package and libflashckpt.
//
// Deliberately thin. Tensors arrive as (name, address, bytes, on_device) tuples that the Python layer
// (flashckpt/_tensors.py) has already checked for dtype, shape, device and contiguity, so this file
// converts types, releases the GIL around everything that blocks or copies, and turns a non-ok
// Status into the exception class that flashckpt.errors maps its code to. The one piece of tensor
// logic here is inspect(): reading an object's DLPack capsule or Python buffer, which Python code
// cannot do without copying.
//
// Lifetime: the addresses stay valid because the Python caller holds the tensors (and, for
// inspect(), the keep-alive object it returns) for the whole call, and, for a snapshot of device
// tensors, until its copies are complete (flashckpt/client.py keeps them with the Snapshot).
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flashckpt/client.h"
#include "flashckpt/offline.h"
#include "flashckpt/version.h"

namespace py = pybind11;

namespace flashckpt {
namespace {

// --- errors ------------------------------------------------------------------------------------

// Raises the flashckpt.errors exception for `status` (FlashckptError or the subclass of its code).
[[noreturn]] void Raise(const Status& status) {
  py::object errors = py::module_::import("flashckpt.errors");
  py::object exc = errors.attr("from_status")(std::string(StatusCodeName(status.code())), status.message());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Take(Result<T>&& result) {
  if (!result.ok()) Raise(result.status());
  return std::move(result).value();
}

std::chrono::milliseconds Millis(double seconds) {
  if (!(seconds > 0)) return std::chrono::milliseconds(1);
  double ms = seconds * 1000.0;
  if (ms > 4.0e9) ms = 4.0e9;  // the RPCs carry uint32 milliseconds
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

// --- inspect: DLPack and the buffer protocol ---------------------------------------------------

// The DLPack ABI (dlpack.h, stable since v0.2), declared here so that no header is needed.
struct DLDevice {
  int32_t device_type;  // 1 CPU, 2 CUDA, 3 CUDA host (pinned), ...
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null: compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

// Safetensors dtype name of a DLPack type, or "" when flashckpt has none for it.
std::string DTypeOfDLPack(DLDataType t) {
  if (t.lanes != 1) return "";
  switch (t.code) {
    case 0:
      return t.bits == 64 ? "I64" : t.bits == 32 ? "I32" : t.bits == 16 ? "I16" : t.bits == 8 ? "I8" : "";
    case 1: return t.bits == 8 ? "U8" : "";
    case 2: return t.bits == 64 ? "F64" : t.bits == 32 ? "F32" : t.bits == 16 ? "F16" : "";
    case 4: return t.bits == 16 ? "BF16" : "";
    case 6: return t.bits == 8 ? "BOOL" : "";
    default: return "";
  }
}

std::string DescribeDLPack(DLDataType t) {
  static const char* const kCodes[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  std::string name = t.code < 7 ? kCodes[t.code] : "code" + std::to_string(t.code);
  name += std::to_string(t.bits);
  if (t.lanes != 1) name += "x" + std::to_string(t.lanes);
  return name;
}

// Safetensors dtype name of a struct-module format character, or "".
std::string DTypeOfFormat(std::string format, ssize_t itemsize) {
  if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<' || format[0] == '!' ||
                          format[0] == '>')) {
    if (format[0] == '>' || format[0] == '!') return "";  // big-endian: not what safetensors stores
    format.erase(0, 1);
  }
  if (format.size() != 1) return "";
  switch (format[0]) {
    case 'd': return itemsize == 8 ? "F64" : "";
    case 'f': return itemsize == 4 ? "F32" : "";
    case 'e': return itemsize == 2 ? "F16" : "";
    case 'q': case 'l': case 'i': case 'h': case 'b':
      return itemsize == 8 ? "I64" : itemsize == 4 ? "I32" : itemsize == 2 ? "I16" : itemsize == 1 ? "I8" : "";
    case 'B': return itemsize == 1 ? "U8" : "";
    case '?': return itemsize == 1 ? "BOOL" : "";
    default: return "";
  }
}

// inspect(obj) -> (address, dtype, shape, strides or None, device_type, device_id, readonly, keepalive)
// dtype is the safetensors name, or "?<description>" when flashckpt does not support it; strides
// are in elements (None: row-major); device_type follows DLPack (1 CPU, 2 CUDA, 3 pinned host).
// The caller keeps `keepalive` until it no longer uses the address.
py::tuple Inspect(const py::object& obj) {
  if (py::hasattr(obj, "__dlpack__")) {
    py::object capsule;
    try {
      capsule = obj.attr("__dlpack__")();
    } catch (py::error_already_set& e) {
      // numpy refuses to export read-only arrays; torch refuses bool. Try the buffer protocol.
      if (!e.matches(PyExc_BufferError) && !e.matches(PyExc_RuntimeError) && !e.matches(PyExc_TypeError)) throw;
      capsule = py::object();
    }
    if (capsule && PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
      auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
      const DLTensor& t = managed->dl_tensor;
      std::string dtype = DTypeOfDLPack(t.dtype);
      if (dtype.empty()) dtype = "?" + DescribeDLPack(t.dtype);
      py::tuple shape(t.ndim);
      for (int32_t i = 0; i < t.ndim; ++i) shape[i] = t.shape[i];
      py::object strides = py::none();
      if (t.strides != nullptr) {
        py::tuple s(t.ndim);
        for (int32_t i = 0; i < t.ndim; ++i) s[i] = t.strides[i];
        strides = std::move(s);
      }
      auto address = reinterpret_cast<uintptr_t>(static_cast<char*>(t.data) + t.byte_offset);
      // The capsule is not consumed: its destructor (the producer's) frees the managed tensor.
      return py::make_tuple(address, dtype, shape, strides, t.device.device_type, t.device.device_id, false, capsule);
    }
  }
  if (!PyObject_CheckBuffer(obj.ptr())) {
    throw py::type_error("object of type " + std::string(py::str(py::type::of(obj).attr("__name__"))) +
                         " is not a tensor: it has neither __dlpack__ nor the buffer protocol");
  }
  PyObject* view = PyMemoryView_FromObject(obj.ptr());
  if (view == nullptr) throw py::error_already_set();
  py::object keep = py::reinterpret_steal<py::object>(view);
  const Py_buffer* b = PyMemoryView_GET_BUFFER(view);
  std::string format = b->format != nullptr ? b->format : "B";
  std::string dtype = DTypeOfFormat(format, b->itemsize);
  if (dtype.empty()) dtype = "?format '" + format + "'";
  py::tuple shape(b->ndim);
  py::tuple strides(b->ndim);
  bool whole = true;
  for (int i = 0; i < b->ndim; ++i) {
    shape[i] = b->shape != nullptr ? b->shape[i] : b->len / b->itemsize;
    ssize_t stride = b->strides != nullptr ? b->strides[i] : 0;
    if (b->strides != nullptr && stride % b->itemsize != 0) whole = false;
    strides[i] = b->itemsize > 0 ? stride / b->itemsize : 0;
  }
  py::object element_strides = b->strides != nullptr ? py::object(strides) : py::object(py::none());
  if (!whole) element_strides = py::make_tuple(-1);  // strides that are not whole elements: never contiguous
  return py::make_tuple(reinterpret_cast<uintptr_t>(b->buf), dtype, shape, element_strides, 1, 0,
                        static_cast<bool>(b->readonly), keep);
}

// --- the client --------------------------------------------------------------------------------

// (name, address, bytes), as flashckpt/_tensors.py builds them.
// (name, address, bytes, on_device): on_device says the address is CUDA device memory.
using PyBuffer = std::tuple<std::string, uintptr_t, uint64_t, bool>;

std::vector<TensorBuffer> Buffers(const std::vector<PyBuffer>& in) {
  std::vector<TensorBuffer> out;
  out.reserve(in.size());
  for (const auto& [name, address, bytes, on_device] : in) {
    out.push_back(TensorBuffer{name, reinterpret_cast<void*>(address), bytes, on_device});
  }
  return out;
}

// A snapshot in flight (SnapshotHandle): with device tensors, Snapshot() returns once the copies are
// queued, and these waits tell when they are done and when the daemon answered the commit.
class PySnapshot {
 public:
  explicit PySnapshot(SnapshotHandle handle) : handle_(std::move(handle)) {}

  void WaitCopied() const {
    Status status;
    {
      py::gil_scoped_release release;
      status = handle_.WaitCopied();
    }
    Check(status);
  }

  void WaitCommitted() const {
    Status status;
    {
      py::gil_scoped_release release;
      status = handle_.WaitCommitted();
    }
    Check(status);
  }

 private:
  SnapshotHandle handle_;
};

TensorKind KindOf(const std::string& kind) {
  if (kind == "model") return TensorKind::kModel;
  if (kind == "optimizer") return TensorKind::kOptimizer;
  if (kind == "master_weight") return TensorKind::kMasterWeight;
  throw py::value_error("tensor kind must be 'model', 'optimizer' or 'master_weight', got '" + kind + "'");
}

DType DTypeOf(const std::string& name) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F64", DType::kF64}, {"F32", DType::kF32}, {"F16", DType::kF16}, {"BF16", DType::kBF16},
      {"I64", DType::kI64}, {"I32", DType::kI32}, {"I16", DType::kI16}, {"I8", DType::kI8},
      {"U8", DType::kU8},   {"BOOL", DType::kBool}};
  for (const auto& [n, d] : kNames) {
    if (name == n) return d;
  }
  throw py::value_error("unsupported dtype '" + name + "'");
}

// One registered tensor as flashckpt/client.py describes it.
struct PySpec {
  std::string name, kind, dtype;
  std::vector<uint64_t> shape, global_shape, box_offset, box_shape;
  std::optional<std::pair<uint64_t, uint64_t>> flat_range;
  bool replica = false;
  std::string param;
};

class PyClient {
 public:
  PyClient(const std::string& socket, const std::string& job, uint32_t rank, double rpc_timeout, double connect_timeout,
           double slot_timeout, bool skip_when_busy, unsigned copy_threads, bool fatal_persist_errors,
           const std::string& run_id, bool overwrite, bool memory_checkpoints) {
    ClientOptions options;
    options.socket_path = socket;
    options.job = job;
    options.rank = rank;
    options.rpc_timeout = Millis(rpc_timeout);
    options.connect_timeout = Millis(connect_timeout);
    options.slot_timeout = Millis(slot_timeout);
    options.skip_when_busy = skip_when_busy;
    options.copy_threads = copy_threads;
    options.fatal_persist_errors = fatal_persist_errors;
    options.run_id = run_id;
    options.overwrite = overwrite;
    options.memory_checkpoints = memory_checkpoints;
    Result<std::unique_ptr<Client>> connected = Status(StatusCode::kInternal, "not connected");
    {
      py::gil_scoped_release release;
      connected = Client::Connect(options);
    }
    client_ = Take(std::move(connected));
  }

  void Register(const std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>& topo,
                const std::vector<PySpec>& specs, const std::optional<py::dict>& ema) {
    Topology topology;
    std::tie(topology.world_size, topology.tp_rank, topology.tp_degree, topology.pp_rank, topology.pp_degree,
             topology.shard_rank, topology.shard_degree) = topo;
    std::vector<TensorSpec> tensors;
    tensors.reserve(specs.size());
    for (const auto& s : specs) {
      TensorSpec t;
      t.name = s.name;
      t.kind = KindOf(s.kind);
      t.dtype = DTypeOf(s.dtype);
      t.shape = s.shape;
      t.global_shape = s.global_shape;
      t.box_offset = s.box_offset;
      t.box_shape = s.box_shape;
      if (s.flat_range) t.flat_range = FlatRange{s.flat_range->first, s.flat_range->second};
      t.replica = s.replica;
      t.param = s.param;
      tensors.push_back(std::move(t));
    }
    EmaOptions options;
    if (ema) {
      const py::dict& e = *ema;
      options.decay = e["decay"].cast<double>();
      options.interval = e["interval"].cast<uint32_t>();
      options.init_zeros = e["init_zeros"].cast<bool>();
      options.all_float_params = e["all_float_params"].cast<bool>();
      if (!e["loss_threshold"].is_none()) options.loss_threshold = e["loss_threshold"].cast<double>();
    }
    Status status;
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;
      status = client->Register(topology, tensors, options);
    }
    Check(status);
  }

  // Returns once the copies of host tensors are done and the commit answered, or once the copies of
  // device tensors are queued on the client's copy stream, after the work queued on `cuda_stream`.
  PySnapshot Snapshot(int64_t step, const std::vector<PyBuffer>& buffers, bool persist, std::optional<double> loss,
                      const py::bytes& extra, const std::string& tier, uintptr_t cuda_stream) {
    SnapshotOptions options;
    options.cuda_stream = reinterpret_cast<void*>(cuda_stream);
    if (tier == "memory") options.tier = Tier::kMemory;
    else if (tier != "disk") Raise(InvalidArgument("snapshot tier must be 'disk' or 'memory', got '" + tier + "'"));
    options.persist = persist;
    options.loss = loss;
    options.extra = std::string(extra);
    std::vector<TensorBuffer> b = Buffers(buffers);
    Result<SnapshotHandle> handle = Status(StatusCode::kInternal, "not run");
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;
      handle = client->Snapshot(step, b, options);
    }
    return PySnapshot(Take(std::move(handle)));
  }

  void WaitPersisted(int64_t step, double timeout) {
    Status status;
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;
      status = client->WaitPersisted(step, Millis(timeout));
    }
    Check(status);
  }

  void WaitComplete(int64_t step, double timeout) {
    Status status;
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;
      status = client->WaitComplete(step, Millis(timeout));
    }
    Check(status);
  }

  std::string RunId() { return Live()->RunId(); }

  // -> (found, step, extra, bytes, tier: "memory" or "disk")
  py::tuple Restore(std::optional<int64_t> step, const std::vector<PyBuffer>& buffers, double timeout,
                    bool convert_dtype, const std::vector<std::string>& kinds, const std::string& source_job,
                    uintptr_t cuda_stream) {
    std::vector<TensorBuffer> b = Buffers(buffers);
    RestoreOptions options;
    options.cuda_stream = reinterpret_cast<void*>(cuda_stream);
    options.convert_dtype = convert_dtype;
    options.source_job = source_job;
    for (const std::string& kind : kinds) {
      if (kind == "model") options.kinds.push_back(TensorKind::kModel);
      else if (kind == "optimizer") options.kinds.push_back(TensorKind::kOptimizer);
      else if (kind == "master_weight") options.kinds.push_back(TensorKind::kMasterWeight);
      else Raise(InvalidArgument("restore kind '" + kind + "' is not model, optimizer or master_weight"));
    }
    Result<RestoreResult> restored = Status(StatusCode::kInternal, "not run");
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;
      restored = client->Restore(step, b, Millis(timeout), options);
    }
    RestoreResult r = Take(std::move(restored));
    return py::make_tuple(r.found, r.step, py::bytes(r.extra), r.bytes, r.tier == Tier::kMemory ? "memory" : r.tier == Tier::kPeer ? "peer" : r.tier == Tier::kParity ? "parity" : "disk");
  }

  // -> (memory steps newest first, disk step or None, extra of extra_of)
  py::tuple Restorable(double timeout, std::optional<int64_t> extra_of, bool verify) {
    Result<RestorableSteps> got = Status(StatusCode::kInternal, "not run");
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;
      got = client->Restorable(Millis(timeout), extra_of, verify);
    }
    RestorableSteps r = Take(std::move(got));
    py::object disk = r.disk_step ? py::object(py::int_(*r.disk_step)) : py::object(py::none());
    return py::make_tuple(r.memory_steps, disk, py::bytes(r.extra));
  }

  // -> (step or None, extra)
  py::tuple DiskExtra(std::optional<int64_t> step, double timeout) {
    Result<RestorableSteps> got = Status(StatusCode::kInternal, "not run");
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;
      got = client->DiskExtra(step, Millis(timeout));
    }
    RestorableSteps r = Take(std::move(got));
    py::object found = r.disk_step ? py::object(py::int_(*r.disk_step)) : py::object(py::none());
    return py::make_tuple(found, py::bytes(r.extra));
  }

  std::vector<std::string> EmaNames() { return Live()->EmaTensorNames(); }

  // -> (initialized, step)
  py::tuple Ema(const std::vector<PyBuffer>& buffers, double timeout) {
    std::vector<TensorBuffer> b = Buffers(buffers);
    Result<EmaResult> got = Status(StatusCode::kInternal, "not run");
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;
      got = client->Ema(b, Millis(timeout));
    }
    EmaResult r = Take(std::move(got));
    return py::make_tuple(r.initialized, r.step);
  }

  std::string StatusJson() {
    Result<std::string> json = Status(StatusCode::kInternal, "not run");
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;
      json = client->StatusJson();
    }
    return Take(std::move(json));
  }

  void Populate() {
    Status status;
    Client* client = Live();  // raises, so it must run with the GIL held
    {
      py::gil_scoped_release release;  // it first waits for a device snapshot's commit thread
      status = client->Populate();
    }
    Check(status);
  }

  void Close() {
    if (!client_) return;
    py::gil_scoped_release release;
    client_->Close();
    client_.reset();
  }

 private:
  Client* Live() {
    if (!client_) Raise(Cancelled("the client is closed"));
    return client_.get();
  }

  std::unique_ptr<Client> client_;
};

}  // namespace
}  // namespace flashckpt

PYBIND11_MODULE(_flashckpt, m) {
  using flashckpt::PyClient;
  using flashckpt::PySpec;
  m.doc() = "Bridge between the flashckpt Python package and libflashckpt; use flashckpt.Client instead.";
  // Whether libflashckpt was built with CUDA, as `flashckpt --version` says: whether it can copy
  // CUDA tensors.
  m.attr("WITH_CUDA") = flashckpt::LibraryHasCuda();
  m.attr("__version__") = flashckpt::LibraryVersion();
  m.def(
      "cuda_info", [] { return flashckpt::LibraryCudaInfo(); },
      "What `flashckpt --version` says of CUDA in this process: compiled in or not, and the devices the "
      "runtime finds (the first call initialises the CUDA driver)");

  m.def(
      "export_checkpoint",
      [](const std::string& dir, const std::string& out, const std::string& weights, const std::string& dtype,
         const std::string& max_shard_size, const std::string& strip_prefix, unsigned threads) {
        flashckpt::ExportOptions options;
        options.weights = weights;
        options.dtype = dtype;
        options.max_shard_size = max_shard_size;
        options.strip_prefix = strip_prefix;
        options.threads = threads;
        flashckpt::ExportReport report;
        flashckpt::Status status;
        {
          py::gil_scoped_release release;
          status = flashckpt::ExportCheckpoint(dir, out, options, &report);
        }
        flashckpt::Check(status);
        return std::make_tuple(report.tensors, report.bytes, report.files, report.index);
      },
      "ExportCheckpoint (flashckpt/offline.h); use flashckpt.export");

  m.def("inspect", &flashckpt::Inspect, py::arg("obj"),
        "(address, dtype, shape, strides, device_type, device_id, readonly, keepalive) of a DLPack or buffer "
        "object");

  py::class_<PySpec>(m, "Spec")
      .def(py::init<>())
      .def_readwrite("name", &PySpec::name)
      .def_readwrite("kind", &PySpec::kind)
      .def_readwrite("dtype", &PySpec::dtype)
      .def_readwrite("shape", &PySpec::shape)
      .def_readwrite("global_shape", &PySpec::global_shape)
      .def_readwrite("box_offset", &PySpec::box_offset)
      .def_readwrite("box_shape", &PySpec::box_shape)
      .def_readwrite("flat_range", &PySpec::flat_range)
      .def_readwrite("replica", &PySpec::replica)
      .def_readwrite("param", &PySpec::param);

  py::class_<flashckpt::PySnapshot>(m, "Snapshot")
      .def("wait_copied", &flashckpt::PySnapshot::WaitCopied)
      .def("wait_committed", &flashckpt::PySnapshot::WaitCommitted);

  py::class_<PyClient>(m, "Client")
      .def(py::init<const std::string&, const std::string&, uint32_t, double, double, double, bool, unsigned, bool,
                    const std::string&, bool, bool>(),
           py::arg("socket"), py::arg("job"), py::arg("rank"), py::arg("rpc_timeout"), py::arg("connect_timeout"),
           py::arg("slot_timeout"), py::arg("skip_when_busy"), py::arg("copy_threads"),
           py::arg("fatal_persist_errors") = false, py::arg("run_id") = "", py::arg("overwrite") = false,
           py::arg("memory_checkpoints") = false)
      .def("register", &PyClient::Register, py::arg("topology"), py::arg("specs"), py::arg("ema"))
      .def("snapshot", &PyClient::Snapshot, py::arg("step"), py::arg("buffers"), py::arg("persist"),
           py::arg("loss"), py::arg("extra"), py::arg("tier") = std::string("disk"), py::arg("cuda_stream") = 0)
      .def("wait_persisted", &PyClient::WaitPersisted, py::arg("step"), py::arg("timeout"))
      .def("wait_complete", &PyClient::WaitComplete, py::arg("step"), py::arg("timeout"))
      .def("run_id", &PyClient::RunId)
      .def("restore", &PyClient::Restore, py::arg("step"), py::arg("buffers"), py::arg("timeout"),
           py::arg("convert_dtype") = false, py::arg("kinds") = std::vector<std::string>{},
           py::arg("source_job") = std::string(), py::arg("cuda_stream") = 0)
      .def("restorable", &PyClient::Restorable, py::arg("timeout"), py::arg("extra_of") = std::nullopt,
           py::arg("verify") = true)
      .def("disk_extra", &PyClient::DiskExtra, py::arg("step"), py::arg("timeout"))
      .def("ema_names", &PyClient::EmaNames)
      .def("ema", &PyClient::Ema, py::arg("buffers"), py::arg("timeout"))
      .def("populate", &PyClient::Populate)
      .def("status_json", &PyClient::StatusJson)
      .def("close", &PyClient::Close);
}
