"""The main job's model: Megatron-LM's default GPT without dropout, built from its network-size flags,
and its loss in the two forms train_step takes."""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

class Block(torch.nn.Module):
    """Megatron-LM's default GPT layer: pre-LayerNorm, multi-head causal attention, GELU MLP, biases."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        # Muon's QKV split (--muon-no-split-qkv turns it off): the rows are Q, K, V of all heads, one block
        # each, i.e. megatron-core's qkv_split_shapes with a single query group.
        self.qkv.weight.qkv_split_shapes = (hidden, hidden, hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, ffn_hidden)
        self.fc2 = torch.nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    """Megatron-LM's GPT from its network-size flags (no dropout): learned absolute positions, blocks,
    a final LayerNorm and the output layer, tied to the input embedding unless
    --untie-embeddings-and-output-weights. Weights ~ N(0, --init-method-std), each block's output
    projections N(0, std / sqrt(2 layers)), biases zero, as Megatron-LM initialises them."""

    def __init__(self, vocab: int, args: argparse.Namespace) -> None:
        super().__init__()
        hidden, layers = args.hidden_size, args.num_layers
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(args.max_position_embeddings or args.seq_length, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, args.num_attention_heads, ffn_hidden_size(args))
                                          for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        tied = not args.untie_embeddings_and_output_weights
        self.head = None if tied else torch.nn.Linear(hidden, vocab, bias=False)
        # What --decoupled-lr applies to (megatron-core marks the same params).
        self.tok.weight.is_embedding_or_output_parameter = True
        if self.head is not None:
            self.head.weight.is_embedding_or_output_parameter = True
        for name, p in self.named_parameters():
            if p.ndim > 1:
                scaled = name.endswith(("proj.weight", "fc2.weight"))
                torch.nn.init.normal_(p, std=args.init_method_std / (math.sqrt(2 * layers) if scaled else 1))
            elif name.endswith(".bias"):
                torch.nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return F.linear(x, self.tok.weight) if self.head is None else self.head(x)


def ffn_hidden_size(args: argparse.Namespace) -> int:
    return args.ffn_hidden_size or 4 * args.hidden_size


def gpt_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies, supervised token count): Megatron's per-token loss form."""
    tokens, labels = batch
    logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def gpt_mean_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor]:
    loss_sum, count = gpt_loss(model, batch)
    return (loss_sum / count.clamp(min=1),)


def model_flops_per_iteration(args: argparse.Namespace, vocab: int) -> float:
    """Training FLOPs of one iteration: 3 x the forward pass (2 per multiply-add) of every matmul,
    attention scores and values included, over the global batch."""
    h, layers, s = args.hidden_size, args.num_layers, args.seq_length
    per_token = layers * (4 * h * h + 2 * h * ffn_hidden_size(args)) + h * vocab
    forward = args.global_batch_size * (2 * s * per_token + layers * 4 * s * s * h)
    return 3.0 * forward


