// A small asynchronous file I/O engine on raw pointers: a pool of threads doing pread/pwrite.
//
// AioEngine(threads, piece_bytes) accepts requests (op, fd, file offset, buffer address, bytes)
// and returns an integer handle at once. Each request is cut into pieces of at most piece_bytes
// that the threads serve in submission order, so one large request keeps several reads or writes
// in flight. wait(handle) blocks with the GIL released until every piece is done and raises
// OSError with the first errno (or on a short read past the end of the file). The caller owns the
// fds and keeps the buffers alive until the request is waited on. An fd opened with O_DIRECT needs
// offset, address and size aligned to the device's block size; that choice is the caller's (see
// elixir/offload/aio.py), the engine only issues the calls.
#include <pybind11/pybind11.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "registry.h"

namespace py = pybind11;

namespace elixir {
namespace {

struct Request {
  int64_t pending = 0;  // pieces not yet finished (guarded by the engine mutex)
  int error = 0;        // first errno seen; -1 for an unexpected end of file
  std::condition_variable done;
};

struct Piece {
  std::shared_ptr<Request> req;
  bool write;
  int fd;
  int64_t offset;
  char* ptr;
  int64_t nbytes;
};

// Transfer one piece fully (retrying partial transfers and EINTR); return 0 or an error code.
int transfer(const Piece& p) {
  int64_t done = 0;
  while (done < p.nbytes) {
    ssize_t n = p.write ? ::pwrite(p.fd, p.ptr + done, static_cast<size_t>(p.nbytes - done), p.offset + done)
                        : ::pread(p.fd, p.ptr + done, static_cast<size_t>(p.nbytes - done), p.offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return -1;  // read past the end of the file (or a write that made no progress)
    done += n;
  }
  return 0;
}

class AioEngine {
 public:
  AioEngine(int threads, int64_t piece_bytes) : piece_bytes_(piece_bytes) {
    if (threads < 1) throw std::invalid_argument("AioEngine needs at least one thread");
    if (piece_bytes < 4096 || piece_bytes % 4096) throw std::invalid_argument("piece_bytes must be a positive multiple of 4096");
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }

  ~AioEngine() { shutdown(); }

  int64_t submit(bool write, int fd, int64_t offset, uintptr_t address, int64_t nbytes) {
    if (fd < 0 || offset < 0 || nbytes < 0) throw std::invalid_argument("AioEngine.submit: negative fd, offset or size");
    if (nbytes > 0 && address == 0) throw std::invalid_argument("AioEngine.submit: null buffer");
    auto req = std::make_shared<Request>();
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw std::runtime_error("AioEngine is closed");
    int64_t handle = next_handle_++;
    char* base = reinterpret_cast<char*>(address);
    for (int64_t at = 0; at < nbytes; at += piece_bytes_) {
      int64_t n = std::min(piece_bytes_, nbytes - at);
      queue_.push_back(Piece{req, write, fd, offset + at, base + at, n});
      ++req->pending;
    }
    requests_.emplace(handle, req);
    work_.notify_all();
    return handle;
  }

  bool poll(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    return find(handle)->pending == 0;
  }

  void wait(int64_t handle) {
    int error = 0;
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(mu_);
      auto req = find(handle);
      req->done.wait(lock, [&] { return req->pending == 0; });
      error = req->error;
      requests_.erase(handle);
    }
    if (error == -1) throw py::value_error("AioEngine: unexpected end of file (read beyond what was written)");
    if (error != 0) {
      errno = error;
      PyErr_SetFromErrno(PyExc_OSError);
      throw py::error_already_set();
    }
  }

  int64_t in_flight() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(requests_.size());
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      work_.notify_all();
    }
    py::gil_scoped_release nogil;
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

 private:
  std::shared_ptr<Request> find(int64_t handle) {
    auto it = requests_.find(handle);
    if (it == requests_.end()) throw py::key_error("AioEngine: unknown or already waited handle " + std::to_string(handle));
    return it->second;
  }

  void run() {
    for (;;) {
      Piece p;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything submitted is done
        p = queue_.front();
        queue_.pop_front();
      }
      int err = transfer(p);
      std::lock_guard<std::mutex> lock(mu_);
      if (err != 0 && p.req->error == 0) p.req->error = err;
      if (--p.req->pending == 0) p.req->done.notify_all();
    }
  }

  const int64_t piece_bytes_;
  std::mutex mu_;
  std::condition_variable work_;
  std::deque<Piece> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  std::vector<std::thread> workers_;
  int64_t next_handle_ = 1;
  bool stopping_ = false;
};

}  // namespace

void register_aio(py::module_& m) {
  py::class_<AioEngine>(m, "AioEngine", "Thread pool of pread/pwrite on raw buffers (see csrc/aio.cpp).")
      .def(py::init<int, int64_t>(), py::arg("threads") = 2, py::arg("piece_bytes") = 8 << 20)
      .def("submit", &AioEngine::submit, py::arg("write"), py::arg("fd"), py::arg("offset"), py::arg("address"),
           py::arg("nbytes"), "Queue one read (write=False) or write; return its handle.")
      .def("poll", &AioEngine::poll, py::arg("handle"), "Whether the request is finished (does not consume it).")
      .def("wait", &AioEngine::wait, py::arg("handle"), "Block (GIL released) until done; raise OSError on failure.")
      .def("in_flight", &AioEngine::in_flight, "Requests submitted and not yet waited on.")
      .def("shutdown", &AioEngine::shutdown, "Finish queued pieces and stop the threads.");
}

}  // namespace elixir
