"""Chunked RoPE on tiny random models of several families and rope types."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from inferscale.kv.encoder import EncodeItem, KVEncoder
from inferscale.kv.rope import RopeRotator, UnsupportedRopeError

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
}


def tiny_model(tmp_path, family: str, rope: dict):
    torch.manual_seed(0)
    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_parameters=rope,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pre_rope_kv_does_not_depend_on_absolute_position(tmp_path, family, rope):
    enc = KVEncoder(tiny_model(tmp_path, family, ROPES[rope]), "float32", device=torch.device("cpu"))
    context, span = tuple(range(3, 40)), tuple(range(50, 70))
    near, far = enc.encode([EncodeItem(context, span, 0), EncodeItem(context, span, 1500)])
    assert torch.allclose(near.keys, far.keys, atol=1e-4), (near.keys - far.keys).abs().max()
    assert torch.allclose(near.values, far.values, atol=1e-4)
    # and the keys really were rotated by position: raw cache keys would differ
    pos = torch.arange(37, 57)
    rotated_near = enc.rotator.rotate(near.keys, pos)
    rotated_far = enc.rotator.rotate(near.keys, pos + 1500)
    assert (rotated_near - rotated_far).abs().max() > 1e-2


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rotate_then_unrotate_is_identity(tmp_path, rope):
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_parameters=ROPES[rope])
    rot = RopeRotator(cfg)
    keys = torch.randn(3, 10, 2, 16)
    pos = torch.arange(100, 110)
    back = rot.unrotate(rot.rotate(keys, pos), pos)
    assert torch.allclose(back, keys, atol=1e-5)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_one_layer_with_shared_tables_equals_all_layers_at_once(rope):
    """The connector's per-layer rotation (cos/sin computed once) writes the same keys."""
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_parameters=ROPES[rope])
    rot = RopeRotator(cfg)
    keys = torch.randn(3, 10, 2, 16)
    pos = torch.arange(40, 50)
    whole, tables = rot.rotate(keys, pos), rot.cos_sin(pos)
    for layer in range(3):
        assert torch.equal(rot.rotate(keys[layer], pos, tables), whole[layer])
    with pytest.raises(ValueError, match="tables cover 9 positions"):
        rot.rotate(keys[0], pos, rot.cos_sin(pos[:9]))


def test_rotation_matches_the_models_own_attention(tmp_path):
    """Keys rotated by us equal the keys the model itself caches at those positions."""
    enc = KVEncoder(tiny_model(tmp_path, "llama", ROPES["llama3"]), "float32", device=torch.device("cpu"))
    ids = torch.arange(5, 25)[None]
    pos = torch.arange(300, 320)[None]
    cache = enc.model(input_ids=ids, position_ids=pos, use_cache=True).past_key_values
    cached = torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers])  # [L, T, H, D]
    (kv,) = enc.encode([EncodeItem((), tuple(range(5, 25)), 0)])
    assert torch.allclose(enc.rotator.rotate(kv.keys, pos[0]), cached, atol=1e-4)


def test_dynamic_rope_is_rejected():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedRopeError, match="dynamic"):
        RopeRotator(cfg)


def test_mismatched_positions_raise():
    rot = RopeRotator(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="positions"):
        rot.rotate(torch.randn(1, 4, 2, 16), torch.arange(3))
