"""Routed experts (Qwen3-MoE): which layers are sparse, as transformers decides it from the same
config; and a step's tokens grouped by expert, each chosen expert run once over just its tokens,
an expert no token chose not run at all."""

from __future__ import annotations

import pytest
import torch
import transformers

from qworker.model.decoder import DecoderModel
from qworker.model.layers.experts import RoutedExperts
from qworker.model.loading.hf_folder import hf_config


@pytest.mark.parametrize(("step", "only"), [(1, []), (1, [0, 4]), (2, []), (3, [2])])
def test_sparse_layers_are_those_transformers_makes_sparse(step: int, only: list[int]) -> None:
    hf = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=step, mlp_only_layers=only)
    reference = transformers.AutoModelForCausalLM.from_config(hf)
    want = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
            for layer in reference.model.layers]
    ours = DecoderModel(hf_config(hf.to_dict()))
    assert [isinstance(layer.mlp, RoutedExperts) for layer in ours.layers] == want
    as_qwen_writes_it = {k: v for k, v in hf.to_dict().items() if k != "num_local_experts"}
    assert hf_config(as_qwen_writes_it | {"num_experts": 4}) == ours.config  # Qwen's config.json
    assert any(want) and bool(step > 1 or only) == (not all(want))  # the cases differ


def test_each_chosen_expert_runs_once_over_just_its_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hf = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=16,
        num_experts_per_tok=2, norm_topk_prob=True)
    layer = DecoderModel(hf_config(hf.to_dict())).layers[0].mlp
    assert isinstance(layer, RoutedExperts)
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(5, 32)  # 5 tokens x 2 choices reach at most 10 of the 16 experts
    calls: dict[int, list[torch.Tensor]] = {}
    for j, expert in enumerate(layer.experts):
        real = expert.forward
        monkeypatch.setattr(expert, "forward",
                            lambda h, fused, j=j, real=real: calls.setdefault(j, []).append(h)
                            or real(h, fused))
    out = layer(x, fused=False)
    chosen, weights = layer.route(x)
    assert torch.allclose(weights.sum(dim=1), torch.ones(5))  # normalized top 2
    assert sorted(calls) == sorted(set(chosen.flatten().tolist()))  # the others never ran
    for j, inputs in calls.items():
        tokens = [t for t in range(5) if j in chosen[t].tolist()]
        assert len(inputs) == 1 and torch.equal(inputs[0], x[tokens])
    want = torch.stack([sum(w * layer.experts[int(e)](x[t : t + 1], False)[0]
                            for e, w in zip(chosen[t], weights[t], strict=True))
                        for t in range(5)])
    torch.testing.assert_close(out, want)
