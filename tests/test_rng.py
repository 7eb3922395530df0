"""Randomness as a compiler contract: keyed random ops, at the graph level (no runtime).

Each model is cut with ``fxpipe.partition``, every stage is rewritten by
``make_randomness_explicit``, and the stages are run in order by hand with one seed per
micro-batch, as the runtime passes (here ``mix(step, micro-batch)``). The checks: the
same seed gives bitwise the same outputs and gradients; the split does not matter; other
micro-batches and other nodes get other masks; eval mode has no dropout; the global
generator is left alone; on CPU the keyed ops equal torch's own from the same generator
state.
"""

from __future__ import annotations

import functools
import threading
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
import torchvision
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxpipe
import fxpipe.compiler.driver
from fxpipe.passes import keyed, scope
from fxpipe.passes.buffers import buffers_written
from fxpipe.passes.meta import MODULE_PATH, RNG_KEY, RNG_SEED
from fxpipe.passes.partition import partition as partition_pass
from fxpipe.passes.rng import make_randomness_explicit, number_random_ops

FRONTENDS = ["fx", "export"]
WIDTH = 16


# ------------------------------------------------------------------ models
class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.drop1 = nn.Linear(WIDTH, 32), nn.Dropout(0.3)
        self.l2, self.drop2 = nn.Linear(32, 32), nn.Dropout(0.5)
        self.l3 = nn.Linear(32, 4)

    def forward(self, x):
        x = self.drop1(torch.relu(self.l1(x)))
        x = self.drop2(torch.relu(self.l2(x)))
        return self.l3(x)


class SamplingNet(nn.Module):
    """Random numbers drawn by torch calls in forward (in train and eval alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(WIDTH, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.l1(x)
        h = h + 0.1 * torch.randn_like(h)
        h = h * torch.bernoulli(torch.full_like(h, 0.8))
        h = self.l2(h)
        h = h + torch.empty_like(h).uniform_(-0.1, 0.1) + 0.01 * nn.init.normal_(torch.empty_like(h))
        return self.l3(h * torch.rand_like(h))


class AttentionBlock(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention`` with dropout."""

    def __init__(self, heads: int = 2, p: float = 0.3) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv, self.out, self.head = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)

    def forward(self, x):
        batch, length = x.size(0), x.size(1)
        qkv = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.head(self.out(a.transpose(1, 2).reshape(batch, length, WIDTH)))


class MHABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.mha = nn.MultiheadAttention(WIDTH, 2, dropout=0.3, batch_first=True)
        self.drop, self.head = nn.Dropout(0.2), nn.Linear(WIDTH, 4)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.mha(h, h, h)
        return self.head(self.drop(a + h))


class EncoderBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layer = nn.TransformerEncoderLayer(WIDTH, 2, dim_feedforward=32, dropout=0.2, batch_first=True)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.head(self.layer(self.inp(x)))


def _tokens() -> torch.Tensor:
    return torch.randn(6, 5, WIDTH, dtype=torch.float64)


CASES = {
    "dropout_mlp": (DropoutMLP, lambda: torch.randn(6, WIDTH, dtype=torch.float64), ["l2", "l3"]),
    "sampling": (SamplingNet, lambda: torch.randn(6, WIDTH, dtype=torch.float64), ["l2", "l3"]),
    "sdpa": (AttentionBlock, _tokens, ["out", "head"]),
    "mha": (MHABlock, _tokens, ["mha", "head"]),
    "encoder_layer": (EncoderBlock, _tokens, ["layer", "head"]),
}
DROPOUT_CASES = ["dropout_mlp", "sdpa", "mha", "encoder_layer"]  # no randomness in eval


# ------------------------------------------------------------------ harness
@pytest.fixture(autouse=True)
def numbered_before_partition(monkeypatch):
    """The compiler keys random ops on the whole graph right before its partition pass."""

    def numbered_then_cut(graph: fx.Graph, num_stages: int):
        number_random_ops(graph)
        return partition_pass(graph, num_stages)

    monkeypatch.setattr(fxpipe.compiler.driver, "partition_pass", numbered_then_cut)


class Keyed:
    """A model partitioned by fxpipe, each stage rewritten, run stage by stage by hand."""

    def __init__(self, model: nn.Module, x: torch.Tensor, split: list[str], frontend: str) -> None:
        self.model = model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.part = fxpipe.partition(model, {"split": split, "frontend": frontend}, example_inputs=(x,))
        self.takes_seed = [make_randomness_explicit(s.module) for s in self.part.stages]

    def train(self, mode: bool = True) -> Keyed:
        self.model.train(mode)
        for stage in self.part.stages:  # export's fxpipe_training flags live in the stages
            stage.module.train(mode)
        return self

    def __call__(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        values: dict[str, object] = {}
        out = None
        for stage, takes_seed in zip(self.part.stages, self.takes_seed):
            args = list(self.part.bind_inputs((x,), {})) if stage.index == 0 else []
            args += [values[e.name] for e in stage.inputs]
            out = stage.module(*args, *([seed] if takes_seed else []))
            values.update(zip((e.name for e in stage.outputs), out if stage.outputs else ()))
        return self.part.build_output(out)

    def keys(self) -> dict[str, int]:
        """Module path of each keyed node -> its key."""
        return {
            n.meta[MODULE_PATH]: n.meta[RNG_KEY]
            for s in self.part.stages for n in s.module.graph.nodes if RNG_KEY in n.meta
        }


def output_and_grads(run, x: torch.Tensor, seed: int, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor, dict]:
    for p in params.values():
        p.grad = None
    out = run(x, seed)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in params.items() if p.grad is not None}


def assert_same(a: tuple, b: tuple) -> None:
    out_a, grads_a = a
    out_b, grads_b = b
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@functools.cache
def _built(case: str, frontend: str) -> tuple[Keyed, Keyed, torch.Tensor]:
    model_cls, make_input, split = CASES[case]
    torch.manual_seed(0)
    model = model_cls().double()
    x = make_input()
    return Keyed(model, x, split, frontend), Keyed(model, x, [], frontend), x


def build(case: str, frontend: str) -> tuple[Keyed, torch.Tensor]:
    """The case cut into 3 stages (built once per session; in train mode)."""
    cut, _, x = _built(case, frontend)
    return cut.train(True), x


STEP = 1234


# ------------------------------------------------------------------ the contract
@pytest.mark.parametrize(
    "case, frontend",
    # export: the cheap cases in make test, the attention blocks (10 s each) in make test-slow
    [(c, f) if f == "fx" or c in ("dropout_mlp", "sampling") else pytest.param(c, f, marks=pytest.mark.slow) for f in FRONTENDS for c in CASES],
)
def test_same_seed_gives_bitwise_equal_outputs_and_grads_and_leaves_global_generator(case, frontend):
    run, x = build(case, frontend)
    assert any(run.takes_seed)
    params = dict(run.model.named_parameters())
    state = torch.get_rng_state()
    first = output_and_grads(run, x, keyed.mix(STEP, 0), params)
    second = output_and_grads(run, x, keyed.mix(STEP, 0), params)
    assert torch.equal(torch.get_rng_state(), state), "a keyed stage drew from the global generator"
    assert_same(first, second)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_split_does_not_change_masks(case, frontend):
    cut, whole, x = _built(case, frontend)
    cut.train(True)
    assert len(cut.part.stages) == 3 and len(whole.part.stages) == 1
    params = dict(cut.model.named_parameters())
    for i in range(2):
        seed = keyed.mix(STEP, i)
        assert_same(output_and_grads(cut, x, seed, params), output_and_grads(whole, x, seed, params))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_other_microbatches_get_other_masks(case, frontend):
    run, x = build(case, frontend)
    with torch.no_grad():
        outputs = [run(x, keyed.mix(STEP, i)) for i in range(3)] + [run(x, keyed.mix(STEP + 1, 0))]
    for i in range(len(outputs)):
        for j in range(i):
            assert not torch.equal(outputs[i], outputs[j]), (i, j)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("case", DROPOUT_CASES)
def test_eval_has_no_dropout_and_train_does(case, frontend):
    if case == "sdpa" and frontend == "fx":
        pytest.skip("fx bakes `p if self.training else 0.0` into the graph as traced (see docs/randomness.md)")
    run, x = build(case, frontend)
    with torch.no_grad():
        train = run.train(True)(x, keyed.mix(STEP, 0))
        run.train(False)
        evaluated = [run(x, keyed.mix(STEP, i)) for i in range(2)]
        eager = run.model(x)
    assert torch.equal(evaluated[0], evaluated[1])
    torch.testing.assert_close(evaluated[0], eager, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(train, evaluated[0]), "dropout was off in training"


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("case", ["dropout_mlp", "mha"])
def test_keyed_pipeline_equals_eager_drawing_from_the_same_generator_state(case, frontend):
    """Each dropout draws what eager's would after manual_seed(draw_seed(seed, key))."""
    run, x = build(case, frontend)
    seed = keyed.mix(STEP, 3)
    keys = run.keys()
    eager_modules = {path: run.model.get_submodule(path) for path in keys}
    assert len(keys) == 2 and all(m.training for m in eager_modules.values())
    params = dict(run.model.named_parameters())
    got = output_and_grads(run, x, seed, params)

    def seeding(key: int):
        def hook(*_) -> None:
            torch.manual_seed(keyed.draw_seed(seed, key))

        return hook

    hooks = [module.register_forward_pre_hook(seeding(keys[path])) for path, module in eager_modules.items()]
    try:
        expected = output_and_grads(lambda x, _: run.model(x), x, seed, params)
    finally:
        for hook in hooks:
            hook.remove()
    assert_same(got, expected)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_microbatch_order_and_threads_do_not_change_masks(frontend):
    run, x = build("mha", frontend)
    seeds = [keyed.mix(STEP, i) for i in range(4)]
    with torch.no_grad():
        expected = [run(x, s) for s in seeds]
        assert [torch.equal(a, b) for a, b in zip(reversed(expected), [run(x, s) for s in reversed(seeds)])] == [True] * 4
        results: dict[tuple[int, int], torch.Tensor] = {}

        def worker(w: int) -> None:
            for rep in range(5):
                for i in range(w, 4, 2):
                    results[(i, rep)] = run(x, seeds[i])

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(torch.equal(results[(i, rep)], expected[i]) for i in range(4) for rep in range(5))


# ------------------------------------------------------------------ the keyed ops
def _gen(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


DROPOUTS = [
    (keyed.dropout, F.dropout, (8, 5), {}),
    (keyed.dropout1d, F.dropout1d, (4, 3, 5), {}),
    (keyed.dropout1d, F.dropout1d, (3, 5), {}),
    (keyed.dropout2d, F.dropout2d, (4, 3, 2, 5), {}),
    (keyed.dropout3d, F.dropout3d, (2, 3, 2, 2, 5), {}),
    (keyed.dropout3d, F.dropout3d, (3, 2, 2, 5), {}),
    (keyed.alpha_dropout, F.alpha_dropout, (8, 5), {"training": True}),
    (keyed.feature_alpha_dropout, F.feature_alpha_dropout, (4, 3, 5), {"training": True}),
]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(("ours", "theirs", "shape", "kwargs"), DROPOUTS)
def test_keyed_dropouts_equal_torch_from_the_same_generator_state(ours, theirs, shape, kwargs, inplace):
    x = torch.randn(shape, dtype=torch.float64)
    torch.manual_seed(7)
    expected = theirs(x.clone(), 0.4, inplace=inplace, **kwargs)
    got = ours(x.clone(), 0.4, inplace=inplace, **kwargs, generator=_gen(7))
    assert torch.equal(got, expected)
    assert not torch.equal(got, x)
    assert torch.equal(ours(x, 0.4, training=False, generator=_gen()), x)


@pytest.mark.parametrize(("name", "flags"), [("dropout", {}), ("feature_dropout", {"feature": True}), ("alpha_dropout", {"alpha": True}), ("feature_alpha_dropout", {"feature": True, "alpha": True})])
def test_aten_level_dropouts_equal_torch(name, flags):
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    torch.manual_seed(3)
    expected = getattr(torch, name)(x, 0.25, True)
    assert torch.equal(keyed.aten_dropout(x, 0.25, True, generator=_gen(3), **flags), expected)
    torch.manual_seed(3)
    expected_, into = getattr(torch, name + "_")(x.clone(), 0.25, True), x.clone()
    assert torch.equal(keyed.aten_dropout(into, 0.25, True, generator=_gen(3), inplace=True, **flags), expected_)
    assert torch.equal(into, expected_)


def test_native_dropout_equals_torch():
    x = torch.randn(6, 7, dtype=torch.float64)
    torch.manual_seed(5)
    out, mask = torch.native_dropout(x, 0.3, True)
    got_out, got_mask = keyed.native_dropout(x, 0.3, True, generator=_gen(5))
    assert torch.equal(got_out, out) and torch.equal(got_mask, mask) and got_mask.dtype == torch.bool
    same, everything = keyed.native_dropout(x, 0.3, False, generator=_gen())
    assert torch.equal(same, x) and bool(everything.all())


def test_keep_rate_scaling_and_gradient_of_keyed_dropout():
    p = 0.3
    x = torch.full((1000, 1000), 2.0, dtype=torch.float64, requires_grad=True)
    out = keyed.dropout(x, p, generator=_gen(11))
    kept = out != 0
    # 1e6 Bernoulli(0.7) draws: the standard deviation of the rate is 4.6e-4, so 0.005 is >10 sigma
    assert abs(kept.double().mean().item() - (1 - p)) < 0.005
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 2.0 / (1 - p)), rtol=1e-15, atol=0)
    grad = torch.randn_like(x)
    out.backward(grad)
    torch.testing.assert_close(x.grad, kept * grad / (1 - p), rtol=1e-15, atol=0)


def test_dropout_rejects_a_probability_outside_0_1():
    with pytest.raises(ValueError, match="between 0 and 1"):
        keyed.dropout(torch.ones(3), 1.5, generator=_gen())


ATTENTION_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "bool_mask": {"attn_mask": "bool"},
    "float_mask": {"attn_mask": "float"},
    "scale": {"scale": 0.3},
    "gqa": {"enable_gqa": True},
}


@pytest.mark.parametrize("variant", list(ATTENTION_CASES))
def test_keyed_attention_equals_torch_math_backend_from_the_same_generator_state(variant):
    kwargs = dict(ATTENTION_CASES[variant])
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    kv_heads = 2 if variant == "gqa" else 4
    k, v = torch.randn(2, kv_heads, 6, 8, dtype=torch.float64), torch.randn(2, kv_heads, 6, 8, dtype=torch.float64)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(5, 6) > 0.3
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(
        keyed.attention(q, k, v, **kwargs, generator=_gen()), F.scaled_dot_product_attention(q, k, v, **kwargs), rtol=0, atol=0
    )
    with sdpa_kernel(SDPBackend.MATH):
        torch.manual_seed(9)
        expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, **kwargs)
    got = keyed.attention(q, k, v, dropout_p=0.4, **kwargs, generator=_gen(9))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, keyed.attention(q, k, v, dropout_p=0.4, **kwargs, generator=_gen(10)))


def test_dropout_module_fast_path_equals_the_keyed_scope():
    x = torch.randn(2, 7, 9, dtype=torch.float64)
    for module_cls in (nn.Dropout, nn.Dropout1d):
        # a subclass with its own forward: fxpipe cannot assume the forward, so it runs scoped
        subclass = type("Own", (module_cls,), {"forward": lambda self, x, cls=module_cls: cls.forward(self, x)})
        fast = scope.call(module_cls(0.4), 5, 3, x)
        scoped = scope.call(subclass(0.4), 5, 3, x)
        assert torch.equal(fast, scoped) and not torch.equal(fast, x)


# ------------------------------------------------------------------ the pass
def jitter(x: torch.Tensor) -> torch.Tensor:
    return x + 0.01 * torch.randn_like(x)


torch.fx.wrap("jitter")  # fx keeps the call whole: its randomness is out of sight


class LeafNoise(nn.Module):
    """A user module kept whole by fx (leaf_modules): its randomness is out of sight."""

    def forward(self, x):
        return F.dropout(x + 0.01 * torch.rand_like(x), 0.5, self.training)


class WithLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.noise, self.l2 = nn.Linear(WIDTH, WIDTH), LeafNoise(), nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.l2(jitter(self.noise(self.l1(x))))


def _single(out):
    """The output tensor (export's graphs return a tuple of the flat outputs)."""
    return out[0] if isinstance(out, tuple) else out


def _traced(model: nn.Module, x: torch.Tensor, frontend: str = "fx", leaf_modules=()) -> fx.GraphModule:
    from fxpipe.passes.shape_prop import propagate_shapes
    from fxpipe.passes.trace import trace

    gm = trace(model, (x,), frontend=frontend, leaf_modules=leaf_modules).graph_module
    propagate_shapes(gm, [x])
    return gm


def test_user_leaf_module_and_wrapped_function_run_under_a_keyed_scope():
    model, x = WithLeaf().double(), torch.randn(4, WIDTH, dtype=torch.float64)
    gm = _traced(model, x, leaf_modules=[LeafNoise])
    assert number_random_ops(gm.graph) == 2
    assert make_randomness_explicit(gm)
    assert "scope_call(noise_module, fxpipe_rng_seed, 0, l1)" in gm.code
    assert "keyed_jitter(fxpipe_rng_seed, 1, noise)" in gm.code
    state = torch.get_rng_state()
    a, b, c = gm(x, 1), gm(x, 1), gm(x, 2)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b) and not torch.equal(a, c)


class StochasticDepthNet(nn.Module):
    """torchvision's stochastic depth: fx keeps ``stochastic_depth`` whole (``fx.wrap``)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)
        self.skip = torchvision.ops.StochasticDepth(0.5, "row")

    def forward(self, x):
        h = self.l1(x)
        return self.l2(h + self.skip(torch.relu(h)))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_torchvision_stochastic_depth_is_keyed(frontend):
    model, x = StochasticDepthNet().double(), torch.randn(64, WIDTH, dtype=torch.float64)
    gm = _traced(model, x, frontend)
    assert number_random_ops(gm.graph) == 1
    assert make_randomness_explicit(gm)
    if frontend == "fx":
        assert "keyed_stochastic_depth(fxpipe_rng_seed, 0" in gm.code
    state = torch.get_rng_state()
    a, b, c = (_single(gm(x, seed)) for seed in (1, 1, 2))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_keys_follow_graph_order_and_renumbering_is_stable():
    gm = _traced(SamplingNet(), torch.randn(3, WIDTH))
    assert number_random_ops(gm.graph) == 5
    keys = [(n.name, n.meta[RNG_KEY]) for n in gm.graph.nodes if RNG_KEY in n.meta]
    assert [k for _, k in keys] == [0, 1, 2, 3, 4]
    assert [name for name, _ in keys] == ["randn_like", "bernoulli", "uniform_", "normal_", "rand_like"]
    number_random_ops(gm.graph)
    assert [(n.name, n.meta[RNG_KEY]) for n in gm.graph.nodes if RNG_KEY in n.meta] == keys


def test_seed_is_the_last_argument_and_the_rewrite_is_idempotent():
    gm = _traced(DropoutMLP(), torch.randn(3, WIDTH))
    number_random_ops(gm.graph)
    assert make_randomness_explicit(gm) and make_randomness_explicit(gm)
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["x", RNG_SEED]
    with pytest.raises(TypeError, match="fxpipe_rng_seed must be an int"):
        gm(torch.randn(3, WIDTH), None)


def test_stage_without_random_ops_is_left_alone():
    gm = _traced(nn.Sequential(nn.Linear(WIDTH, 4), nn.ReLU()), torch.randn(3, WIDTH))
    code = gm.code
    assert number_random_ops(gm.graph) == 0
    assert make_randomness_explicit(gm) is False and gm.code == code


class LiteralProbabilities(nn.Module):
    """Random-looking calls that draw nothing (p = 0, attention without dropout_p) and one
    that draws (p = 0.1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, 0.0) + torch.dropout(x, 0.0, True)
        q = x.view(x.shape[0], 1, 4, WIDTH // 4)
        x = x + F.scaled_dot_product_attention(q, q, q).reshape(x.shape)
        return F.dropout(x, 0.1)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_calls_with_a_literal_zero_probability_draw_nothing_and_are_not_keyed(frontend):
    gm = _traced(LiteralProbabilities(), torch.randn(3, WIDTH), frontend)
    assert number_random_ops(gm.graph) == 1  # only the p = 0.1 dropout
    assert make_randomness_explicit(gm)
    x = torch.randn(3, WIDTH)

    def run(seed: int) -> torch.Tensor:
        out = gm(x, seed)
        return out[0] if isinstance(out, tuple) else out  # export returns a flat tuple

    assert torch.equal(run(keyed.mix(1, 2)), run(keyed.mix(1, 2)))
    assert not torch.equal(run(keyed.mix(1, 2)), run(keyed.mix(1, 3)))  # the p = 0.1 one draws


def test_unnumbered_random_node_is_an_error_that_names_the_fix():
    gm = _traced(DropoutMLP(), torch.randn(3, WIDTH))
    with pytest.raises(ValueError, match="drop1.*number_random_ops on the whole graph before partitioning"):
        make_randomness_explicit(gm)


def test_rewritten_stage_runs_on_fake_tensors():
    gm = _traced(MHABlock(), torch.randn(2, 5, WIDTH), frontend="export")
    number_random_ops(gm.graph)
    make_randomness_explicit(gm)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        (out,) = gm(mode.from_tensor(torch.randn(3, 5, WIDTH)), keyed.mix(1, 2))
    assert out.shape == (3, 5, 4)


_lib = torch.library.Library("fxpipe_rng_test", "DEF")  # noqa: TID251 - test-only operators
_lib.define("opaque_noise(Tensor x) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
_lib.impl("opaque_noise", lambda x: x + torch.rand_like(x), "CPU")
_lib.impl("opaque_noise", lambda x: torch.empty_like(x), "Meta")
_lib.define("composite_noise(Tensor x) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
_lib.impl("composite_noise", lambda x: x + torch.rand_like(x), "CompositeImplicitAutograd")


class OpaqueNoise(nn.Module):
    def forward(self, x):
        return torch.ops.fxpipe_rng_test.opaque_noise(x)


class CompositeNoise(nn.Module):
    def forward(self, x):
        return torch.ops.fxpipe_rng_test.composite_noise(x)


def test_custom_op_without_generator_warns_at_compile_time():
    gm = _traced(OpaqueNoise(), torch.randn(3, 4))
    with pytest.warns(UserWarning, match="node 'opaque_noise'.*takes no generator"):
        assert number_random_ops(gm.graph) == 0
    assert make_randomness_explicit(gm) is False


def test_composite_custom_op_is_keyed_through_its_decomposition():
    gm = _traced(CompositeNoise(), torch.randn(3, 4))
    assert number_random_ops(gm.graph) == 1
    assert make_randomness_explicit(gm)
    x = torch.randn(3, 4)
    state = torch.get_rng_state()
    a, b, c = gm(x, 1), gm(x, 1), gm(x, 2)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_random_op_inside_cond_warns_at_compile_time():
    class Branchy(nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: x + torch.rand_like(x), lambda x: x - 1, (x,))

    gm = _traced(Branchy(), torch.randn(3, 4), frontend="export")
    with pytest.warns(UserWarning, match="node 'cond'.*inside cond .a higher-order op. cannot be keyed"):
        assert number_random_ops(gm.graph) == 0


def test_unkeyable_op_inside_a_scope_warns_once_at_run_time():
    model = nn.Sequential(nn.Linear(4, 4), OpaqueNoise())
    gm = _traced(model, torch.randn(3, 4), leaf_modules=[OpaqueNoise])
    number_random_ops(gm.graph)
    make_randomness_explicit(gm)
    with pytest.warns(UserWarning, match="opaque_noise.*inside OpaqueNoise draws from torch's global generator"):
        gm(torch.randn(3, 4), 1)


# ------------------------------------------------------------------ buffers_written
class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class Counters(nn.Module):
    """Buffers written by ops in forward: in place, through a view, and by operator."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("history", torch.zeros(3, 4))
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        # each write takes a traced value, so torch.fx records it rather than running it
        self.steps.add_(x.shape[0])
        self.ema.view(x.shape[1] // 2, 2).mul_(0.9)
        self.ema.add_(0.1 * x.detach().mean(0))
        self.history[x.new_zeros(1, dtype=torch.long)] = x.detach()[:1]
        return self.lin(x) * self.scale


def _stats(*names: str) -> set[str]:
    return {f"{n}.{b}" for n in names for b in ("running_mean", "running_var", "num_batches_tracked")}


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_buffers_written_finds_batchnorm_statistics_per_stage(frontend):
    model = ConvBN()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        part = fxpipe.partition(model, {"split": ["conv2"], "frontend": frontend}, example_inputs=(torch.randn(4, 3, 6, 6),))
    assert [set(buffers_written(s.module)) for s in part.stages] == [_stats("bn1"), _stats("bn2")]
    whole = _traced(model, torch.randn(4, 3, 6, 6), frontend)
    assert set(buffers_written(whole)) == _stats("bn1", "bn2")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_buffers_written_covers_every_buffer_the_forward_changes(frontend):
    model, x = Counters(), torch.randn(5, 4)
    gm = _traced(model, x, frontend)
    written = buffers_written(gm)
    assert set(written) == {"steps", "ema", "history"}
    before = {n: b.clone() for n, b in gm.named_buffers()}
    gm(x)
    changed = {n for n, b in gm.named_buffers() if not torch.equal(b, before[n])}
    assert changed == set(written)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_buffer_free_model_writes_no_buffers(frontend):
    gm = _traced(DropoutMLP(), torch.randn(3, WIDTH), frontend)
    assert buffers_written(gm) == []


def test_buffers_of_an_opaque_user_module_count_as_written_even_after_the_rng_rewrite():
    class Tracker(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen += x.shape[0]
            return F.dropout(x, 0.1, self.training)

    model = nn.Sequential(nn.Linear(4, 4), Tracker())
    gm = _traced(model, torch.randn(3, 4), leaf_modules=[Tracker])
    assert buffers_written(gm) == ["1.seen"]
    number_random_ops(gm.graph)
    make_randomness_explicit(gm)
    assert buffers_written(gm) == ["1.seen"]


# ------------------------------------------------------------------ the seed scheme
def test_mix_is_stable_and_spreads():
    # pinned: a change of the scheme changes every mask a saved seed reproduces
    assert keyed.mix(0, 0) == 0xE220A8397B1DCDAF
    seeds = {keyed.mix(s, i) for s in range(64) for i in range(64)}
    assert len(seeds) == 64 * 64 and all(0 <= s < 2**64 for s in seeds)
    assert keyed.mix(-1, 3) == keyed.mix(2**64 - 1, 3)


def test_each_thread_has_its_own_generator():
    mine = keyed.generator(1, 2, torch.zeros(1))
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(keyed.generator(1, 2, torch.zeros(1))))
    thread.start()
    thread.join()
    assert theirs[0] is not mine and keyed.generator(3, 4, "cpu") is mine
    assert keyed.generator(1, 2, torch.empty(1, device="meta")) is None
