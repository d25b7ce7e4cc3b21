"""Joined projections (model_loaders/shared/joined.py): a LLaMA-family block's q, k, v and gate, up run as one layer
each, filled from a checkpoint's parts as it loads and split back for writing; the messages name the parts.
(Against transformers' own classes and the official releases' codes: test_chameleon.py, test_janus.py and the
conformance tests, which fail when the parts are stacked in another order.)"""
import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.shared.checkpoint import load_weights
from fastar.model_loaders.shared.joined import joined_parts, parted_state_dict
from fastar.model_loaders.shared.llm_decoder import Backbone, DecoderConfig

CFG = DecoderConfig(hidden_size=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=48, vocab_size=50)


def checkpoint() -> dict:
    """A checkpoint in the releases' layout (q, k, v, gate and up apart), random values."""
    torch.manual_seed(0)
    return {k: torch.randn(v.shape) for k, v in parted_state_dict(Backbone(CFG)).items()}


def fresh() -> Backbone:
    with torch.device("meta"):
        return Backbone(CFG)


def test_parts_load_into_the_joined_layers_and_split_back_unchanged():
    sd = checkpoint()
    assert {"layers.0.self_attn.q_proj.weight", "layers.1.mlp.up_proj.weight"} <= set(sd)
    model = fresh()
    load_weights(model, sd, "test")
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert torch.equal(attn.qkv_proj.weight, torch.cat([sd[f"layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([sd["layers.1.mlp.gate_proj.weight"],
                                                           sd["layers.1.mlp.up_proj.weight"]]))
    back = parted_state_dict(model)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    assert joined_parts(model)["layers.0.self_attn.qkv_proj.weight"] == (
        ("layers.0.self_attn.q_proj.weight", 32), ("layers.0.self_attn.k_proj.weight", 16),
        ("layers.0.self_attn.v_proj.weight", 16))  # 4 query heads and 2 key-value heads of 8 channels


def test_a_joined_weight_stored_whole_loads_as_it_is():
    whole = {k: v.clone() for k, v in Backbone(CFG).state_dict().items()}
    model = fresh()
    load_weights(model, whole, "test")
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, whole["layers.0.self_attn.qkv_proj.weight"])


def test_a_missing_part_is_named_and_its_siblings_are_not_called_unexpected():
    sd = checkpoint()
    del sd["layers.1.self_attn.k_proj.weight"]
    with pytest.raises(FastARError) as caught:
        load_weights(fresh(), sd, "test.safetensors")
    message = str(caught.value)
    assert "missing layers.1.self_attn.k_proj.weight (an incomplete file" in message
    assert "unexpected" not in message and "qkv_proj" not in message


def test_a_part_of_the_wrong_size_is_named_as_the_file_names_it():
    sd = checkpoint()
    sd["layers.0.mlp.up_proj.weight"] = torch.zeros(40, 32)
    with pytest.raises(FastARError, match=r"wrong shapes layers\.0\.mlp\.up_proj\.weight \(40, 32\) vs \(48, 32\) "
                                          r"\(checkpoint vs model"):
        load_weights(fresh(), sd, "test.safetensors")
    whole = {k: v.clone() for k, v in Backbone(CFG).state_dict().items()}
    whole["layers.0.mlp.gate_up_proj.weight"] = torch.zeros(88, 32)  # a joined weight stored whole
    with pytest.raises(FastARError, match=r"wrong shapes layers\.0\.mlp\.gate_up_proj\.weight \(88, 32\) vs \(96, 32\)"):
        load_weights(fresh(), whole, "test.safetensors")
