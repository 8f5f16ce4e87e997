"""benchmarks/train_profile_table.py: device time of a train step by category
(the categoriser, a real CPU trace of the MoE's functions, the table from a
saved per-op JSON) and m2jax.config.dense_counterpart, the dense baseline
of experiments.bench_train."""

import json
import os
import time

import jax
import jax.numpy as jnp
import pytest

from benchmarks import profile as profile_lib
from benchmarks import train_profile_table as tpt
from m2jax import config as config_lib
from m2jax import params
from m2jax.model import layers, moe
from m2jax.settings import Settings

_PREFIX = "jit(train_step)/transpose(jvp(Transformer))/"


@pytest.mark.parametrize("scope,opcodes,want", [
    (_PREFIX + "layers_3/attn/btd,dkh->btkh/dot_general", ["dot"],
     "attention"),
    (_PREFIX + "layers_3/attn/q_norm/mul", ["multiply"], "norms_rope"),
    (_PREFIX + "layers_3/attn/rope/mul", ["multiply"], "norms_rope"),
    (_PREFIX + "layers_3/ffn_norm/mul", ["multiply"], "norms_rope"),
    (_PREFIX + "Transformer.head/final_norm/mul", ["multiply"], "norms_rope"),
    (_PREFIX + "layers_3/moe/experts/pallas_call", ["custom-call"],
     "expert_matmuls"),
    (_PREFIX + "layers_3/mlp/btd,df->btf/dot_general", ["dot"],
     "expert_matmuls"),
    (_PREFIX + "layers_3/moe/dispatch/gather", ["gather"], "dispatch"),
    (_PREFIX + "layers_3/moe/combine/scatter-add", ["scatter"], "dispatch"),
    (_PREFIX + "mtp_0/block_0/moe/router/dot_general", ["dot"], "router"),
    (_PREFIX + "layers_3/moe/routing_stats/reduce_sum", ["reduce"],
     "router"),
    (_PREFIX + "Transformer.head/btd,dv->btv/dot_general", ["dot"],
     "lm_head_ce"),
    ("jit(train_step)/jvp()/reduce_max", ["reduce"], "lm_head_ce"),
    (_PREFIX + "Transformer.embed/jit(_take)/scatter-add", ["scatter"],
     "embedding"),
    ("jit(train_step)/jit(tree_bias_correction)/div", ["divide"],
     "optimizer"),
    ("jit(train_step)/mul", ["multiply", "add", "sqrt"], "optimizer"),
    # Pure data movement is a copy wherever it came from.
    (_PREFIX + "layers_3/attn/transpose", ["fusion", "transpose", "copy"],
     "copies"),
    (_PREFIX + "layers_3/add", ["add"], "other"),
    # Collectives (the all-gather exchange's, sequence parallelism's) are
    # communication wherever they came from.
    (_PREFIX + "layers_3/moe/dispatch/all_gather", ["all-gather-start"],
     "communication"),
    (_PREFIX + "layers_3/moe/combine/reduce_scatter",
     ["async-start", "reduce-scatter"], "communication"),
    # No scope (an op XLA made up): its kind decides.
    ("sort", ["sort"], "dispatch"),
    ("", ["add", "multiply"], "other"),
])
def test_categorize_by_scope_then_kind(scope, opcodes, want):
  assert tpt.categorize({"name": "op.1", "scope": scope,
                         "opcodes": opcodes}) == want


def test_categorize_by_name_without_hlo():
  assert tpt.categorize({"name": "loop_transpose_fusion.3"}) == "copies"
  assert tpt.categorize({"name": "sort.1"}) == "dispatch"
  assert tpt.categorize({"name": "cutlass_gemm"}) == "other"
  assert tpt.categorize(
      {"name": "ncclDevKernel_AllGather_RING_LL"}) == "communication"


class _Event:
  def __init__(self, name, start_ns, duration_ns):
    self.name, self.start_ns, self.duration_ns = name, start_ns, duration_ns
    self.stats = {}


class _Line:
  def __init__(self, name, events):
    self.name, self.events = name, events


class _Plane:
  def __init__(self, name, lines):
    self.name, self.lines = name, lines


def test_one_gpu_of_a_multi_gpu_trace():
  # An SPMD program on two GPUs holds each op once per GPU: `device` keeps
  # one GPU's ops (and its busy time and span).
  planes = [_Plane(f"/device:GPU:{d}", [
      _Line("XLA Ops", [_Event("fusion.1", 10 + d, 5),
                        _Event("all-gather-start.2", 20, 3)]),
      _Line("Stream #1", [_Event("k", 10 + d, 5), _Event("k", 20, 3)])])
            for d in (0, 1)]
  data = type("Data", (), {"planes": planes})()
  both = profile_lib._op_events(data)  # pylint: disable=protected-access
  one = profile_lib._op_events(data, 1)  # pylint: disable=protected-access
  assert len(both["ops"]) == 4 and len(one["ops"]) == 2
  assert [o["start_ns"] for o in one["ops"]] == [11, 20]
  assert one["busy_ns"] == 8 and one["span_ns"] == 12


_HLO = """HloModule jit_f, is_scheduled=true

%fused_computation.1 (param_0: bf16[8,4], param_1: bf16[4,4]) -> bf16[8,4] {
  %param_0 = bf16[8,4]{1,0} parameter(0)
  %convert.1 = f32[8,4]{1,0} convert(%param_0), metadata={op_name="jit(f)/jvp(Transformer)/layers_0/attn/convert_element_type"}
  ROOT %dot.1 = bf16[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/jvp(Transformer)/layers_0/moe/router/dot_general"}
}

%fused_computation.2 (param_0.1: f32[8,4]) -> f32[4,8] {
  %param_0.1 = f32[8,4]{1,0} parameter(0)
  ROOT %transpose.1 = f32[4,8]{1,0} transpose(%param_0.1), dimensions={1,0}
}

ENTRY %main.9 (p0: bf16[8,4], p1: bf16[4,4]) -> (f32[4,8], s32[8]) {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = bf16[4,4]{1,0} parameter(1)
  %gemm_fusion = bf16[8,4]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%fused_computation.1, metadata={op_name="jit(f)/jvp(Transformer)/layers_0/attn/convert_element_type"}
  %transpose_fusion = f32[4,8]{1,0} fusion(%gemm_fusion), kind=kLoop, calls=%fused_computation.2, metadata={op_name="jit(f)/jvp(Transformer)/layers_0/attn/transpose"}
  %custom-call.3 = (f32[8,2]{1,0}, s32[8,2]{1,0}) custom-call(%p0), custom_call_target="TopK", metadata={op_name="jit(f)/x/moe/router/top_k"}
  ROOT %t = (f32[4,8]{1,0}, s32[8]{0}) tuple(%transpose_fusion, %custom-call.3)
}
"""


def test_parse_hlo_names_a_fusion_by_its_anchor():
  ops = tpt.parse_hlo(_HLO)
  # The fusion's own metadata is its cast's; its dot says what it is.
  gemm = ops["gemm_fusion"]
  assert gemm["scope"].endswith("moe/router/dot_general")
  assert set(gemm["opcodes"]) == {"fusion", "parameter", "convert", "dot"}
  assert tpt.categorize({"name": "gemm_fusion", **gemm}) == "router"
  assert tpt.categorize({"name": "transpose_fusion",
                         **ops["transpose_fusion"]}) == "copies"
  assert ops["custom-call.3"]["kind"] == "custom-call:TopK"


def _moe_layer(x_TxD, w):
  """The MoE's functions and RoPE, as the model calls them (their named
  scopes are what the categoriser reads)."""
  router, w1, w3, w2 = w
  routing = moe.route(x_TxD, router, None, top_k=2, gating="sigmoid",
                      scaling=1.0)
  x_sorted, sizes, sort = moe.dispatch(x_TxD, routing, router.shape[1])
  y = moe.swiglu_experts(x_sorted, sizes, w1, w3, w2,
                         settings=Settings(gmm_backend="xla"))
  y = moe.combine(y, routing, sort)
  positions = jnp.arange(x_TxD.shape[0])[None]
  q = layers.apply_partial_rope(y.reshape(1, -1, 2, 8), positions, 4, 1e4)
  return x_TxD + q.reshape(x_TxD.shape)


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
  """A real CPU trace of two jitted MoE steps and its summary."""
  D, E, F = 16, 4, 8
  keys = jax.random.split(jax.random.key(0), 5)
  w = (jax.random.normal(keys[0], (D, E)),
       jax.random.normal(keys[1], (E, D, F)) * 0.1,
       jax.random.normal(keys[2], (E, D, F)) * 0.1,
       jax.random.normal(keys[3], (E, F, D)) * 0.1)
  x = jax.random.normal(keys[4], (32, D))
  # A constant of this process's own makes the program new to the
  # session's persistent cache, whose key leaves out the ops' names: a
  # cached program would bring the names of the code that cached it.
  salt = float(time.time_ns() % 999983 + 2)
  step = jax.jit(lambda x, w: (_moe_layer(x, w) + (x[0, 0] == salt), None)
                 ).lower(x, w).compile()
  step(x, w)
  trace_dir = str(tmp_path_factory.mktemp("trace"))
  _, summary = tpt.capture(step, x, [w], steps=2, trace_dir=trace_dir,
                           hlo_text=step.as_text(), label="moe")
  return trace_dir, summary


def test_real_cpu_trace_is_categorised(cpu_trace):
  trace_dir, summary = cpu_trace
  assert summary["platform"] == "cpu" and summary["steps"] == 2
  ms = tpt.category_ms(summary)
  # The model's named scopes reach the trace: each part of the MoE has time.
  for category in ("router", "dispatch", "expert_matmuls", "norms_rope"):
    assert ms[category] > 0, (category, ms)
  assert summary["hlo_ops_known"] == len(
      [op for op in summary["ops"] if op["opcodes"]]) > 0
  assert 0 < summary["busy_ms"] <= summary["span_ms"]
  assert ms["idle"] == pytest.approx(summary["span_ms"] - summary["busy_ms"])
  # benchmarks.profile.summarize reads CPU traces too.
  xplane, hlo = tpt.find_files(trace_dir)
  assert hlo.endswith(".hlo.txt")
  cpu = profile_lib.summarize(xplane)
  assert cpu["ops"] and cpu["busy_ns"] > 0
  # The trace directory alone rebuilds the same summary.
  again = tpt.load(trace_dir)
  assert again["label"] == "moe" and again["steps"] == 2
  assert tpt.category_ms(again) == pytest.approx(ms)


def test_small_ops_are_merged_with_exact_totals(cpu_trace):
  trace_dir, summary = cpu_trace
  xplane, hlo = tpt.find_files(trace_dir)
  with open(hlo, encoding="utf-8") as f:
    small = tpt.summarize_trace(xplane, 2, f.read(), max_ops=3)
  assert len([op for op in small["ops"] if not op.get("merged")]) == 3
  assert tpt.category_ms(small) == pytest.approx(tpt.category_ms(summary))


def test_table_from_saved_json(cpu_trace, tmp_path, capsys):
  _, summary = cpu_trace
  path = tmp_path / "run.ops.json"
  path.write_text(json.dumps(summary, separators=(",", ":")))
  assert os.path.getsize(path) < 2 * 2**20
  tpt.main([str(path)])
  table = capsys.readouterr().out
  ms = tpt.category_ms(summary)
  total = sum(ms.values())
  for key, label in tpt.CATEGORIES:
    assert f"| {label} | {ms[key]:.3f} | {ms[key] / total:.1%} |" in table
  assert f"| **total** | **{total:.3f}** | 100% |" in table
  bad = tmp_path / "bad.json"
  bad.write_text("{}")
  with pytest.raises(SystemExit, match="not a per-op summary"):
    tpt.main([str(bad)])


def test_dense_counterpart_has_the_moe_active_ffn_width():
  cfg = config_lib.TINY
  dense = config_lib.dense_counterpart(cfg)
  assert dense.ffn_type == "dense"
  assert dense.dense_intermediate_size == (cfg.num_experts_per_tok
                                           * cfg.moe_intermediate_size)
  moe_counts, dense_counts = params.count_params(cfg), params.count_params(
      dense)
  # The dense FFN holds exactly the experts' active weights; the router
  # and its bias are what the MoE adds on top.
  active_experts = (moe_counts["breakdown"]["experts"]
                    * cfg.num_experts_per_tok // cfg.num_experts)
  assert dense_counts["breakdown"]["dense_mlp"] == active_experts
  routers = (moe_counts["breakdown"]["router"]
             + moe_counts["breakdown"]["expert_bias"])
  assert dense_counts["active_params"] == moe_counts["active_params"] - routers
  for name in ("attention", "embedding", "lm_head", "norms"):
    assert dense_counts["breakdown"][name] == moe_counts["breakdown"][name]
  mtp_routers = (cfg.num_experts * cfg.hidden_size + cfg.num_experts
                 ) * cfg.mtp_transformer_layers
  assert params.flops_per_token(dense, 64, mtp_depth=1) == (
      params.flops_per_token(cfg, 64, mtp_depth=1)
      - 2 * params.FWD_BWD * (routers + mtp_routers))
  with pytest.raises(config_lib.ConfigError, match="ffn_type"):
    config_lib.dense_counterpart(dense)
