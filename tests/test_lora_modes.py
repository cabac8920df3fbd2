"""LoRA beyond the reference oracle: the BF16 merge (exact arithmetic, its error bound against the exact
layer output, against diffusers' `fuse_lora`), the contract branch (its error bound beside the reference
branch's), and one clear error for every bad file or call, with nothing applied halfway.

The bounds below are first-order rounding-error analyses of each layer's arithmetic, computed in float64
from the layer's own operands, so they hold on any machine: bf16 roundings (unit roundoff u = 2^-8), and
fp32 accumulation of exact bf16 x bf16 products in any order (Higham's gamma_n = n v / (1 - n v),
v = 2^-24), as every torch backend does for bf16 GEMMs (oneDNN and torch's own CPU kernels, cuBLAS).
"""

import math
from dataclasses import dataclass

import pytest
import torch
from diffusers import QwenImagePipeline as DiffusersQwenImagePipeline
from helpers import diffusers_twin
from lora_files import (
    block_modules,
    linear_shapes,
    random_factors,
    shared_pipeline,
    write_kohya,
    write_lightning,
    write_peft,
)
from safetensors.torch import save_file

from qwen_image_fusion.models.errors import CheckpointError, InputError
from qwen_image_fusion.models.lora import lora_layers
from qwen_image_fusion.pipelines import load_pipeline

MODULE = "transformer_blocks.1.attn.to_q"


@pytest.fixture(scope="module")
def base():
    pipe = load_pipeline(variant="contract", device="cpu")
    pipe.base_state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    return pipe


@pytest.fixture
def pipe(base):
    yield from shared_pipeline(base, "contract")


@pytest.fixture(scope="module")
def two_loras(base, tmp_path_factory):
    """A kohya LoRA (alpha 4, rank 8) and a Lightning-layout one (bf16, alpha 2, rank 16) on one layer."""
    tmp = tmp_path_factory.mktemp("loras")
    shapes = linear_shapes(base.transformer)
    layers = base.transformer.config.num_layers
    kohya = write_kohya(
        tmp / "style.safetensors", random_factors(shapes, block_modules(layers), 8, seed=11), 4.0
    )
    factors = random_factors(shapes, block_modules(layers), 16, seed=12, dtype=torch.bfloat16)
    return kohya, write_lightning(tmp / "fast.safetensors", factors, 2.0)


def _forward(pipe) -> torch.Tensor:
    """One transformer call on fixed inputs."""
    gen = torch.Generator().manual_seed(0)
    model = pipe.transformer
    latents = torch.randn(1, 16, 64, generator=gen).to(pipe.dtype)
    prompt = torch.randn(1, 5, model.config.joint_attention_dim, generator=gen).to(pipe.dtype)
    with torch.no_grad():
        return model(latents, prompt, None, torch.full((1,), 0.6), (1, 4, 4)).float()


U_BF16, U_FP32 = 2.0**-8, 2.0**-24


def gamma(n: int) -> float:
    """Higham's gamma_n in fp32: a sum of n + 1 exact terms accumulated in fp32, in any order, is off by at
    most gamma_n times the sum of their magnitudes."""
    return n * U_FP32 / (1 - n * U_FP32)


@dataclass
class LayerTerms:
    """One LoRA layer on one input, in float64 from its bf16 operands: the exact output
    `z = x W^T + b + sum_i s_i (x A_i^T) B_i^T`, the same without the LoRAs, and the magnitudes the error
    bounds scale with: M = |x| |W|^T + |b| (base) and L = sum_i |s_i| (|x| |A_i|^T) |B_i|^T (LoRAs)."""

    exact: torch.Tensor
    exact_base: torch.Tensor
    base: torch.Tensor
    lora: torch.Tensor
    k: int  # the base GEMM's inner size
    ranks: list[int]

    def contract_branch_bound(self) -> torch.Tensor:
        """Contract branch: `base(x)` (<= 2 bf16 roundings: product, bias), `h = bf16(x [A_1; A_2]^T)`
        (1), `up = bf16(s_i B_i)` (1, plus 2 fp32 for s and the product), `result += h up^T` (<= 2: the
        product, the sum): first order M (3u + g_K) + L (5u + 2v + g_K + g_R), R the stacked rank."""
        u, rank = U_BF16, sum(self.ranks)
        on_lora = 5 * u + 2 * U_FP32 + gamma(self.k) + gamma(rank)
        first = self.base * (3 * u + gamma(self.k)) + self.lora * on_lora
        return first * (1 + u) ** 4  # second-order terms: each magnitude grows by at most (1 + u) a rounding

    def reference_branch_bound(self) -> torch.Tensor:
        """PEFT's branch, per adapter i of n: `bf16(x A_i^T)`, `bf16(. B_i^T)`, `bf16(. * s_i)` (3, plus
        fp32 s_i), `result = bf16(result + .)` (1 per adapter, on M + L); `base(x)` as above:
        first order M (2u + n u + g_K) + L (4u + n u + v + g_K + g_r), r the largest rank."""
        u, n = U_BF16, len(self.ranks)
        on_lora = 4 * u + n * u + U_FP32 + gamma(self.k) + gamma(max(self.ranks))
        first = self.base * (2 * u + n * u + gamma(self.k)) + self.lora * on_lora
        return first * (1 + u) ** (4 + n)

    def merged_bound(self) -> torch.Tensor:
        """BF16 merge: `W' = bf16(W + sum_i fp32(fp32(B_i A_i) * s_i))` (g_r, then fp32 s_i and product,
        the sum over adapters and the add to W: <= 4 v; one bf16 rounding u), then `bf16(x W'^T + b)` (<= 2
        roundings, g_K): first order (M + L) (3u + 4v + g_K + g_r)."""
        u = U_BF16
        first = (self.base + self.lora) * (3 * u + 4 * U_FP32 + gamma(self.k) + gamma(max(self.ranks)))
        return first * (1 + u) ** 3


def layer_terms(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, adapters) -> LayerTerms:
    """`LayerTerms` of input x [..., K] for a base weight [N, K], bias [N] and (A_i, B_i, s_i) adapters."""
    x64 = x.double().reshape(-1, x.shape[-1])
    w64 = weight.double()
    b64 = torch.zeros(w64.shape[0], dtype=torch.float64) if bias is None else bias.double()
    exact_base = x64 @ w64.T + b64
    exact, lora = exact_base.clone(), torch.zeros_like(exact_base)
    for down, up, s in adapters:
        a64, bb64 = down.double(), up.double()
        exact += s * ((x64 @ a64.T) @ bb64.T)
        lora += abs(s) * ((x64.abs() @ a64.abs().T) @ bb64.abs().T)
    base = x64.abs() @ w64.abs().T + b64.abs()
    return LayerTerms(exact, exact_base, base, lora, x.shape[-1], [down.shape[0] for down, _, _ in adapters])


def lora_layer_inputs(pipe) -> dict[str, torch.Tensor]:
    """The input each LoRA layer sees in `_forward`'s transformer call, by module name."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        return lambda module, args: seen.setdefault(name, args[0].detach().clone())

    hooks = [w.register_forward_pre_hook(keep(name)) for name, w in lora_layers(pipe.transformer).items()]
    try:
        _forward(pipe)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def branch_terms(pipe, inputs: dict[str, torch.Tensor]) -> dict[str, LayerTerms]:
    """`LayerTerms` of every LoRA layer on its captured input, from the base weights and adapters now
    mounted (call in branch mode: the weights are the original ones)."""
    terms = {}
    for name, wrapper in lora_layers(pipe.transformer).items():
        adapters = [(f.down, f.up, wrapper.scaling(a)) for a, f in wrapper.adapters.items()]
        base = wrapper.base_layer
        terms[name] = layer_terms(inputs[name], base.weight, base.bias, adapters)
    return terms


def layer_outputs(pipe, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each LoRA layer's output on its captured input, as the pipeline's mode and variant run it, [M, N]."""
    with torch.no_grad():
        return {
            name: wrapper(inputs[name]).double().reshape(-1, wrapper.out_features)
            for name, wrapper in lora_layers(pipe.transformer).items()
        }


def assert_within(outputs: dict[str, torch.Tensor], terms: dict[str, LayerTerms], bound: str) -> None:
    """Every layer's output within its `bound` of the exact output, and the bound tight enough that
    leaving the LoRAs out (or a wrong scale of that size) would fail it somewhere in every layer."""
    for name, got in outputs.items():
        t = terms[name]
        limit = getattr(t, bound)()
        over = (got - t.exact).abs() > limit
        assert not bool(over.any()), f"{name}: {int(over.sum())} outputs beyond the {bound}"
        assert bool(((t.exact - t.exact_base).abs() > limit).any()), f"{name}: {bound} too loose to matter"


@pytest.mark.cpu_dtype
@pytest.mark.numerics
def test_bf16_merge_is_one_rounding_of_the_exact_sum_and_unmerges_bit_for_bit(pipe, two_loras):
    pipe.load_lora(two_loras[0], scale=0.7, name="style")
    pipe.load_lora(two_loras[1], scale=1.3, name="fast")
    wrapper = lora_layers(pipe.transformer)[MODULE]
    original = wrapper.base_layer.weight.clone()
    inputs = lora_layer_inputs(pipe)
    terms = branch_terms(pipe, inputs)
    branch = layer_outputs(pipe, inputs)

    pipe.set_lora_mode("merge")
    assert pipe.lora_merge.bf16_layers == len(lora_layers(pipe.transformer))
    exact = original.float()
    for name in ("style", "fast"):
        f = wrapper.adapters[name]
        exact = exact + (f.up.float() @ f.down.float()) * f.scaling(pipe.loras[name].scale)
    merged_weight = wrapper.base_layer.weight
    assert torch.equal(merged_weight, exact.to(torch.bfloat16))
    # every merged layer within the merge's error bound of the exact layer output, as is the branch
    # within its own; so they differ by less than the two bounds together, and they do differ
    merged = layer_outputs(pipe, inputs)
    assert_within(merged, terms, "merged_bound")
    assert_within(branch, terms, "contract_branch_bound")
    assert any(not torch.equal(merged[name], branch[name]) for name in merged)

    pipe.set_lora_scales({"fast": 0.5})  # re-merged from the kept original, not on top of the old merge
    f = wrapper.adapters
    rescaled = original.float() + (f["style"].up.float() @ f["style"].down.float()) * f["style"].scaling(0.7)
    rescaled = rescaled + (f["fast"].up.float() @ f["fast"].down.float()) * f["fast"].scaling(0.5)
    assert torch.equal(wrapper.base_layer.weight, rescaled.to(torch.bfloat16))

    pipe.set_lora_mode("branch")
    assert torch.equal(wrapper.base_layer.weight, original)
    pipe.unload_lora()
    state = pipe.transformer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in pipe.base_state.items())


def test_our_merge_is_never_further_from_the_exact_sum_than_diffusers_fuse_lora(pipe, two_loras):
    """diffusers' `fuse_lora` (PEFT's merge) rounds each delta to bf16 and adds it in bf16; ours sums in
    fp32 and rounds once, so each merged weight is the nearest bf16 to the fp32 sum."""
    pipe.load_lora(two_loras[0], scale=0.7, name="style")
    pipe.load_lora(two_loras[1], scale=1.3, name="fast")
    theirs = diffusers_twin(pipe, DiffusersQwenImagePipeline, pipe.base_state)
    theirs.load_lora_weights(str(two_loras[0]), adapter_name="style")
    theirs.load_lora_weights(str(two_loras[1]), adapter_name="fast")
    theirs.set_adapters(["style", "fast"], [0.7, 1.3])
    theirs.fuse_lora(adapter_names=["style", "fast"])
    wrapper = lora_layers(pipe.transformer)[MODULE]
    original = wrapper.base_layer.weight.float()
    pipe.set_lora_mode("merge")
    exact = original + wrapper.delta_weight()
    ours = wrapper.base_layer.weight.float()
    fused = theirs.transformer.get_submodule(MODULE).base_layer.weight.float()
    assert ((ours - exact).abs() <= (fused - exact).abs()).all()
    assert (ours != fused).any(), "the two merges round differently (a third of all merged weights)"


@pytest.mark.numerics
def test_contract_branch_stacks_loras_in_two_gemms_close_to_peft_arithmetic(pipe, two_loras):
    """Every LoRA layer, on the input it sees in a transformer call: the contract branch (two GEMMs for
    both LoRAs) and PEFT's op-for-op branch (the reference variant) each within its error bound of the
    exact layer output; they round differently."""
    pipe.load_lora(two_loras[0], scale=0.7, name="style")
    pipe.load_lora(two_loras[1], scale=1.3, name="fast")
    inputs = lora_layer_inputs(pipe)
    terms = branch_terms(pipe, inputs)
    contract = layer_outputs(pipe, inputs)
    assert lora_layers(pipe.transformer)[MODULE]._stacked[0].shape[0] == 8 + 16
    pipe.set_variant("reference")
    reference = layer_outputs(pipe, inputs)
    assert_within(contract, terms, "contract_branch_bound")
    assert_within(reference, terms, "reference_branch_bound")
    assert any(not torch.equal(contract[name], reference[name]) for name in contract)
    pipe.set_lora_scales({"fast": 0.0})  # a zero scale leaves the contract branch (and its GEMMs)
    pipe.set_variant("contract")
    stacked = lora_layers(pipe.transformer)[MODULE]._stacked
    assert stacked[0].shape[0] == 8  # only the rank-8 style LoRA is left in the stacked factors


def _factors(pipe, modules, rank=4, seed=21):
    return random_factors(linear_shapes(pipe.transformer), modules, rank, seed)


def _bad_files(pipe, tmp):
    """(path, expected message) for files that must be refused, each with one problem."""
    good = [f"transformer_blocks.0.attn.{m}" for m in ("to_q", "to_k")]
    cases = []

    def peft(name, factors, message):
        cases.append((write_peft(tmp / name, factors), message))

    text = tmp / "notes.safetensors"
    text.write_text("not a tensor file at all")
    cases.append((text, "is not a safetensors file"))
    pickled = tmp / "pickled.safetensors"
    torch.save({"a": torch.ones(2)}, pickled)
    cases.append((pickled, "is not a safetensors file"))
    save_file({}, tmp / "empty.safetensors")
    cases.append((tmp / "empty.safetensors", "holds no tensors"))
    factors = _factors(pipe, good)
    factors["transformer_blocks.9.attn.to_q"] = tuple(t.clone() for t in factors[good[0]])
    peft("no-layer.safetensors", factors, "transformer_blocks.9.attn.to_q.lora_A.weight matches no linear")
    factors = _factors(pipe, good)
    factors["transformer_blocks.0.attn.norm_q"] = (torch.ones(4, 32), torch.ones(32, 4))
    peft("not-linear.safetensors", factors, "attn.norm_q.lora_A.weight matches no linear layer")
    factors = _factors(pipe, good)
    factors[good[1]] = (torch.ones(4, 48), factors[good[1]][1])
    width = pipe.transformer.config.inner_dim
    peft(
        "shape.safetensors",
        factors,
        f"to_k factors [4, 48] and [{width}, 4] do not fit the layer's {width} inputs",
    )
    factors = _factors(pipe, good)
    factors[good[1]] = (factors[good[1]][0], torch.ones(64, 8))
    peft("pair.safetensors", factors, "are not a rank-r pair")
    factors = _factors(pipe, good)
    factors[good[1]][0][2, 5] = math.nan
    peft(
        "nan.safetensors", factors, "tensor transformer.transformer_blocks.0.attn.to_k.lora_A.weight has NaN"
    )
    kohya = write_kohya(tmp / "inf-alpha.safetensors", _factors(pipe, good), math.inf)
    cases.append((kohya, "lora_unet_transformer_blocks_0_attn_to_k.alpha has NaN or inf"))
    down, up = _factors(pipe, good)[good[0]]
    save_file({f"transformer.{good[0]}.lora_A.weight": down}, tmp / "half.safetensors")
    cases.append((tmp / "half.safetensors", "to_q.lora_B.weight is missing"))
    tensors = {f"transformer.{good[0]}.lora_A.weight": down, f"transformer.{good[0]}.lora_B.weight": up}
    save_file(tensors | {f"transformer.{good[0]}.lora_B.bias": torch.ones(64)}, tmp / "bias.safetensors")
    cases.append((tmp / "bias.safetensors", "lora_B.bias is not supported"))
    loha = {"lora_unet_transformer_blocks_0_attn_to_q.hada_w1_a": torch.ones(4, 64)}
    save_file(
        loha | {"lora_unet_transformer_blocks_0_attn_to_q.alpha": torch.tensor(4.0)}, tmp / "loha.safetensors"
    )
    cases.append((tmp / "loha.safetensors", "diffusers' LoRA conversion refuses it"))
    return cases


def test_bad_files_give_one_error_naming_file_and_key_and_change_nothing(pipe, tmp_path):
    for path, message in _bad_files(pipe, tmp_path):
        with pytest.raises(CheckpointError) as err:
            pipe.load_lora(path)
        assert message in str(err.value) and str(path) in str(err.value), (path.name, str(err.value))
        assert "\n" not in str(err.value)
        assert not pipe.loras and not lora_layers(pipe.transformer), f"{path.name} left something mounted"
    state = pipe.transformer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in pipe.base_state.items())


def test_bad_calls_are_refused_by_name(pipe, two_loras, tmp_path):
    with pytest.raises(InputError, match=r"LoRA file /nonexistent\.safetensors does not exist"):
        pipe.load_lora("/nonexistent.safetensors")
    with pytest.raises(InputError, match="is not a file"):
        pipe.load_lora(tmp_path)
    assert pipe.load_lora(two_loras[0]) == "style"
    with pytest.raises(InputError, match="a LoRA named 'style' is already loaded"):
        pipe.load_lora(two_loras[1], name="style")
    with pytest.raises(InputError, match="LoRA scale nan for fast must be a finite number"):
        pipe.load_lora(two_loras[1], scale=math.nan)
    with pytest.raises(InputError, match=r"no LoRA named 'nope' is loaded \(loaded: style\)"):
        pipe.set_lora_scales({"style": 0.5, "nope": 1.0})
    assert pipe.loras["style"].scale == 1.0, "a refused call changes nothing"
    assert pipe.load_lora(two_loras[0]) == "style-2"  # the same file twice: a second name
    with pytest.raises(InputError, match="no LoRA named 'nope'"):
        pipe.unload_lora("nope")
    with pytest.raises(InputError, match="LoRA mode 'fuse' is not one of branch, merge"):
        pipe.set_lora_mode("fuse")
    with pytest.raises(InputError, match="preset 'lightning-2' is not one of"):
        pipe.generate("a fox", preset="lightning-2")


def test_generate_applies_lora_scales_for_its_run(pipe, two_loras):
    """What the UI sends with each run: the scales, in force for that run; the lasting scale stays the one
    loaded (tests/test_lora_per_call.py checks the images)."""
    pipe.load_lora(two_loras[0], scale=0.0)
    pipe.generate("a fox", width=32, height=32, num_inference_steps=2, seed=1, lora_scales={"style": 0.5})
    assert pipe.loras["style"].scale == 0.0
    assert (
        pipe.last_run.loras
        == f"LoRA (branch): style x0.5 on {14 * pipe.transformer.config.num_layers} layers"
    )
    with pytest.raises(InputError, match="no LoRA named 'fast'"):
        pipe.generate("a fox", lora_scales={"fast": 1.0})
