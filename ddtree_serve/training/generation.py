"""Batched continuation of prompts by the target, for the drafter's self-distillation data.

The drafter is judged on how well it predicts what the *target* will emit, so part of its
training data is the target's own greedy and sampled continuations (as DFlash trains on
target-regenerated responses). All rows share one length, so the KV cache is a plain
preallocated tensor per layer with one fill level.
"""

import torch
from tqdm import tqdm

from ddtree_serve.models.layers import causal_mask
from ddtree_serve.models.qwen3 import Qwen3ForCausalLM
from ddtree_serve.training.loop import autocast_for


class DenseKVCache:
    """`KVStore` for equal-length rows: per layer `[B, max_len, kv_heads, head_dim]` key/value tensors."""

    def __init__(self, model: Qwen3ForCausalLM, batch_size: int, max_len: int, dtype: torch.dtype) -> None:
        config = model.config
        shape = (batch_size, max_len, config.num_key_value_heads, config.head_dim)
        device = model.lm_head.weight.device
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [
            torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)
        ]
        self.length = 0  # tokens already cached, same for every row and layer

    def update(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + keys.shape[1]
        self.keys[layer_idx][:, self.length : end] = keys
        self.values[layer_idx][:, self.length : end] = values
        return self.keys[layer_idx][:, :end], self.values[layer_idx][:, :end]

    def advance(self, num_tokens: int) -> None:
        """Called once per forward, after every layer has written its `num_tokens` entries."""
        self.length += num_tokens


@torch.no_grad()
def continue_prompts(
    model: Qwen3ForCausalLM,
    prompts: torch.Tensor,
    num_new_tokens: int,
    num_sampled: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """`prompts [B, P]` -> `[B, P + num_new_tokens]`, all rows in one pass.

    Row b samples (temperature 1) its first `num_sampled[b]` new tokens and continues greedily
    after them: 0 gives a greedy row, `num_new_tokens` a fully sampled one, and anything between
    a greedy continuation of a context the target wrote itself (novel text, not memorised).
    """
    batch_size, prompt_len = prompts.shape
    device = prompts.device
    cache_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = DenseKVCache(model, batch_size, prompt_len + num_new_tokens, cache_dtype)
    out = torch.empty(batch_size, prompt_len + num_new_tokens, dtype=torch.int64, device=device)
    out[:, :prompt_len] = prompts
    num_sampled = num_sampled.to(device)
    was_training = model.training
    model.eval()
    with autocast_for(device):
        positions = torch.arange(prompt_len, device=device).expand(batch_size, prompt_len)
        hidden = model(prompts, positions, causal_mask(prompt_len, device), kv_store=cache).hidden
        cache.advance(prompt_len)
        for step in tqdm(range(num_new_tokens), desc="generate", mininterval=2.0):
            logits = model.logits(hidden[:, -1]).float()  # [B, V]
            sampled = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
            next_token = torch.where(step < num_sampled, sampled, logits.argmax(dim=-1))
            pos = prompt_len + step
            out[:, pos] = next_token
            if step + 1 == num_new_tokens:
                break
            positions = torch.full((batch_size, 1), pos, device=device)
            visible = torch.ones(1, 1, cache.length + 1, dtype=torch.bool, device=device)
            hidden = model(next_token[:, None], positions, visible, kv_store=cache).hidden
            cache.advance(1)
    model.train(was_training)
    return out
