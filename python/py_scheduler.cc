// Python binding of kvwire::SchedulerHalf: the scheduler half of kvwire's vLLM plugin
// (python/kvwire/vllm_scheduler.py converts vLLM's objects into these calls).
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kvwire/scheduler_half.h"
#include "python/py_support.h"

namespace kvwire_py {
namespace {

uint64_t Count(int64_t n) { return static_cast<uint64_t>(std::max<int64_t>(n, 0)); }

}  // namespace

void BindSchedulerHalf(py::module_& m) {
  using kvwire::SchedulerHalf;
  py::class_<SchedulerHalf>(m, "SchedulerHalf",
                            "The connector's scheduler decisions for a scheduler process "
                            "without an engine (include/kvwire/scheduler_half.h).")
      .def(py::init([](const std::string& engine_id, const std::string& mode,
                       const std::vector<std::string>& groups, int64_t block_size, int tp_size,
                       const std::string& host_ip) {
             kvwire::SchedulerHalfOptions o;
             o.engine_id = engine_id;
             o.mode = Take(kvwire::ParseKvMode(mode));
             o.groups = groups;
             o.block_size = InRange<uint64_t>("block_size", block_size, 1, 1 << 20);
             o.tp_size = tp_size;
             o.host_ip = host_ip;
             return Take(SchedulerHalf::Create(std::move(o)));
           }),
           py::arg("engine_id"), py::arg("mode") = "auto",
           py::arg("groups") = std::vector<std::string>{"0"}, py::arg("block_size") = 16,
           py::arg("tp_size") = 1, py::arg("host_ip") = "")
      .def(
          "set_workers",
          [](SchedulerHalf& s,
             const std::map<int, std::tuple<std::string, std::string, std::string>>& workers) {
            std::map<int, kvwire::SchedulerWorker> w;
            for (const auto& [rank, t] : workers) {
              w[rank] = {std::get<0>(t), std::get<1>(t), std::get<2>(t)};
            }
            s.SetWorkers(std::move(w));
          },
          py::arg("workers"), "{tp rank: (engine_id, address host:port, host or '')}")
      .def("worker",
           [](const SchedulerHalf& s, int rank) -> py::object {
             std::optional<kvwire::SchedulerWorker> w = s.Worker(rank);
             if (!w) return py::none();
             return py::make_tuple(w->engine_id, w->address, w->host);
           })
      .def(
          "get_num_new_matched_tokens",
          [](SchedulerHalf& s, const std::string& id, int64_t prompt, int64_t computed,
             const std::string& params) {
            kvwire::MatchResult r =
                s.GetNumNewMatchedTokens(id, Count(prompt), Count(computed), params);
            return py::make_tuple(r.num_external_tokens, r.load_async);
          },
          py::arg("request_id"), py::arg("prompt_tokens"), py::arg("num_computed_tokens"),
          py::arg("kv_transfer_params"))
      .def(
          "update_state_after_alloc",
          [](SchedulerHalf& s, const std::string& id, int64_t prompt, int64_t computed,
             const std::string& params, const kvwire::BlockLists& blocks, int64_t external) {
            s.UpdateStateAfterAlloc(id, Count(prompt), Count(computed), params, blocks,
                                    Count(external));
          },
          py::arg("request_id"), py::arg("prompt_tokens"), py::arg("computed_tokens"),
          py::arg("kv_transfer_params"), py::arg("blocks"), py::arg("num_external_tokens"))
      .def(
          "build_connector_meta",
          [](SchedulerHalf& s, const std::map<std::string, int64_t>& scheduled,
             const std::map<std::string, int64_t>& computed,
             const std::map<std::string, kvwire::BlockLists>& new_blocks) {
            kvwire::SchedulerStep step;
            for (const auto& [id, n] : scheduled) step.scheduled_tokens[id] = Count(n);
            for (const auto& [id, n] : computed) step.computed_tokens[id] = Count(n);
            step.new_blocks = new_blocks;
            return s.BuildConnectorMeta(step);
          },
          py::arg("scheduled_tokens") = std::map<std::string, int64_t>{},
          py::arg("computed_tokens") = std::map<std::string, int64_t>{},
          py::arg("new_blocks") = std::map<std::string, kvwire::BlockLists>{},
          "this step's work for the workers (JSON: loads, saves, holds, finishes, failed, "
          "releases)")
      .def(
          "request_finished",
          [](SchedulerHalf& s, const std::string& id, int64_t prompt, const std::string& params,
             const kvwire::BlockLists& blocks, bool hands_off, bool flat) {
            kvwire::RequestFinishedResult r =
                s.RequestFinished(id, Count(prompt), params, blocks, hands_off, flat);
            return py::make_tuple(r.delay_free, r.kv_transfer_params);
          },
          py::arg("request_id"), py::arg("prompt_tokens"), py::arg("kv_transfer_params"),
          py::arg("blocks"), py::arg("hands_off"), py::arg("flat") = false,
          "(delay freeing the blocks, kv_transfer_params JSON for the decode or '')")
      .def("update_connector_output", &SchedulerHalf::UpdateConnectorOutput,
           py::arg("finished_recving"), py::arg("finished_sending"))
      .def("pending_push_work", &SchedulerHalf::PendingPushWork)
      .def("take_log", &SchedulerHalf::TakeLog, "[(logging level, message)] since the last call")
      .def("state_json", &SchedulerHalf::StateJson);
}

}  // namespace kvwire_py
