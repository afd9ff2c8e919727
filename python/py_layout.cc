// Python binding of shareable buffers, KV memory ranges and layouts (kvwire/layout.h).
#include <utility>
#include <vector>

#include "kvwire/layout.h"
#include "python/py_support.h"

namespace kvwire_py {

void BindLayouts(py::module_& m) {
  py::class_<Buffer>(m, "Buffer", py::buffer_protocol())
      .def(py::init([](size_t length) {
        return Buffer{Take(kvwire::ShareableBuffer::Create(length, "kvwire-py"))};
      }))
      .def_property_readonly(
          "address", [](const Buffer& b) { return reinterpret_cast<uint64_t>(b.rep.data()); })
      .def("__len__", [](const Buffer& b) { return b.rep.size(); })
      .def_buffer([](Buffer& b) {
        return py::buffer_info(b.rep.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {b.rep.size()}, {1});
      });

  py::class_<kvwire::KvMemory>(m, "KvMemory")
      .def(py::init([](uint64_t ptr, size_t length, const std::string& kind, int gpu_device) {
             if (kind != "host" && kind != "gpu") {
               throw py::value_error("KvMemory kind must be 'host' or 'gpu', not '" + kind + "'");
             }
             kvwire::KvMemory km;
             km.ptr = reinterpret_cast<void*>(ptr);
             km.length = length;
             km.kind = kind == "gpu" ? kvwire::MemoryKind::kGpu : kvwire::MemoryKind::kHost;
             km.gpu_device = gpu_device;
             return km;
           }),
           py::arg("ptr"), py::arg("length"), py::arg("kind") = "host", py::arg("gpu_device") = -1,
           "A registered range: host memory, or GPU memory ('gpu', e.g. a CUDA tensor's "
           "data_ptr(); gpu_device -1 asks the runtime)")
      .def_property_readonly(
          "ptr", [](const kvwire::KvMemory& k) { return reinterpret_cast<uint64_t>(k.ptr); })
      .def_readonly("length", &kvwire::KvMemory::length)
      .def_property_readonly("kind",
                             [](const kvwire::KvMemory& k) {
                               return k.kind == kvwire::MemoryKind::kGpu ? "gpu" : "host";
                             })
      .def_readonly("gpu_device", &kvwire::KvMemory::gpu_device);

  py::class_<kvwire::CacheGroup>(m, "CacheGroup")
      .def_readonly("name", &kvwire::CacheGroup::name)
      .def_readonly("layers", &kvwire::CacheGroup::layers)
      .def_readonly("tokens_per_block", &kvwire::CacheGroup::tokens_per_block)
      .def_readonly("page_bytes", &kvwire::CacheGroup::page_bytes)
      .def_readonly("tokens_per_entry", &kvwire::CacheGroup::tokens_per_entry)
      .def_readonly("window_tokens", &kvwire::CacheGroup::window_tokens)
      .def_readonly("per_request_state", &kvwire::CacheGroup::per_request_state)
      .def_readonly("components", &kvwire::CacheGroup::components)
      .def_readonly("section_row_bytes", &kvwire::CacheGroup::section_row_bytes)
      .def_readonly("num_blocks", &kvwire::CacheGroup::num_blocks)
      .def("block_address", &kvwire::CacheGroup::BlockAddress, py::arg("layer_index"),
           py::arg("block"), py::arg("component") = 0)
      .def(
          "unfilled_page_spans",
          [](const kvwire::CacheGroup& g, uint64_t logical_block, uint64_t num_tokens) {
            std::vector<std::pair<uint64_t, uint64_t>> out;
            for (const kvwire::PageSpan& s :
                 Take(kvwire::UnfilledPageSpans(g, logical_block, num_tokens))) {
              out.emplace_back(s.offset, s.length);
            }
            return out;
          },
          py::arg("logical_block"), py::arg("num_tokens"),
          "(offset, length) of the bytes of a page of this logical block that a request of "
          "num_tokens tokens did not fill: what a read grant clears first");

  py::class_<kvwire::Layout>(m, "Layout")
      .def_static("preset", [](const std::string& n) { return Take(kvwire::PresetLayout(n)); })
      .def_static("from_json", [](const std::string& j) { return Take(kvwire::LayoutFromJson(j)); })
      .def("to_json", [](const kvwire::Layout& l) { return kvwire::LayoutToJson(l); })
      .def_readonly("model", &kvwire::Layout::model)
      .def_readonly("groups", &kvwire::Layout::groups)
      .def("group",
           [](const kvwire::Layout& l, const std::string& name) {
             const kvwire::CacheGroup* g = l.FindGroup(name);
             if (g == nullptr) throw py::key_error(name);
             return *g;
           })
      .def(
          "assign_backing",
          [](kvwire::Layout& l, uint64_t base, uint64_t blocks, uint64_t state_blocks) {
            return kvwire::AssignBacking(&l, base, blocks, state_blocks);
          },
          py::arg("base"), py::arg("num_blocks"), py::arg("state_blocks") = 0)
      .def("check_compatible", [](const kvwire::Layout& prefill, const kvwire::Layout& decode) {
        Check(kvwire::CheckCompatible(prefill, decode));
      });

  m.def(
      "select_blocks",
      [](const kvwire::CacheGroup& g, uint64_t tokens, uint64_t cached) {
        kvwire::BlockSelection s = kvwire::SelectBlocks(g, tokens, cached);
        return py::make_tuple(s.logical_blocks, s.slot_begin, s.slot_count);
      },
      py::arg("group"), py::arg("num_tokens"), py::arg("num_cached_tokens") = 0,
      "(logical blocks, state slot begin, state slot count) that move for a request");
  m.def(
      "plan_transfer",
      [](const kvwire::Layout& src, const kvwire::BlockTable& sb, const kvwire::Layout& dst,
         const kvwire::BlockTable& db, uint64_t tokens, uint64_t cached) {
        kvwire::TransferPlan p = Take(kvwire::PlanTransfer(src, sb, dst, db, tokens, cached));
        py::dict d;
        d["bytes"] = p.bytes;
        d["ops_before_merge"] = p.ops_before_merge;
        d["ops_after_merge"] = p.ops_after_merge;
        return d;
      },
      py::arg("src"), py::arg("src_blocks"), py::arg("dst"), py::arg("dst_blocks"),
      py::arg("num_tokens"), py::arg("num_cached_tokens") = 0);
}

}  // namespace kvwire_py
