"""Per-GPU peaks other people measured on real GPUs, kept as data with their sources and settings, and the
estimate of each (`python benchmarks/published.py` prints the table; tests/unit/test_published.py holds each case to
its tolerance). Only cases whose program the estimator can express are kept.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..settings import GIB, TrainSetting


def llama31_8b():
    """Llama 3.1 8B's shapes as a transformers config (torchtitan trains its own implementation of them)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False,
                       name_or_path="llama-3.1-8b")


def lightning_transformer_tiny():
    """`lightning_transformer`'s architecture small enough for CPU ranks (4 + 4 layers, d_model 64, 500 words)."""
    return lightning_transformer(vocab=500, ninp=64, nhead=4, nhid=128, nlayers=4)


def lightning_transformer(**sizes):
    """The 1B model of Lightning's FSDP guide (its demo `Transformer`: `nn.Transformer`, 32 encoder and 32 decoder
    layers, d_model 1024, 64 heads, feed-forward 4096, dropout 0.2, WikiText2's 33,278 words), written here with torch
    alone, with the guide's batch (one sequence of 35 tokens and its shifted target) and loss (NLL of log-softmax);
    its units are the encoder and decoder layers, as the guide's wrap policy makes them."""
    from ..custom import CustomModel

    words = sizes.get("vocab", _WIKITEXT2_WORDS)

    def tokens(batch_size, seq_len):
        import torch

        return (torch.randint(0, words, (batch_size, seq_len)), torch.randint(0, words, (batch_size, seq_len)))

    def loss(model, batch):
        import torch.nn.functional as F

        inputs, target = batch
        return F.nll_loss(model(inputs, target), target.view(-1))

    def layers(model):
        return [*model.transformer.encoder.layers, *model.transformer.decoder.layers]

    return CustomModel(build=functools.partial(_lightning_transformer, **sizes), batch=tokens, loss=loss,
                       blocks=layers, name="Lightning's demo Transformer" + (" (1B)" if not sizes else " (tiny)"))


_WIKITEXT2_WORDS = 33278


def _lightning_transformer(**sizes):
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class PositionalEncoding(nn.Module):
        # As the guide's demo runs it: the table is made on the first forward (a plain tensor, no buffer) and the
        # sum with it is discarded; only dropout acts.
        def __init__(self, dim):
            super().__init__()
            self.dropout, self.dim, self.pe = nn.Dropout(0.2), dim, None

        def forward(self, x):
            if self.pe is None:
                position = torch.arange(0, 5000, dtype=torch.float, device=x.device).unsqueeze(1)
                scale = torch.exp(torch.arange(0, self.dim, 2, device=x.device).float() * (-math.log(1e4) / self.dim))
                self.pe = torch.zeros(5000, self.dim, device=x.device)
                self.pe[:, 0::2], self.pe[:, 1::2] = torch.sin(position * scale), torch.cos(position * scale)
                self.pe = self.pe.unsqueeze(0).transpose(0, 1)
            return self.dropout(x)

    class Transformer(nn.Module):
        def __init__(self, vocab=_WIKITEXT2_WORDS, ninp=1024, nhead=64, nhid=4096, nlayers=32):
            super().__init__()
            self.pos_encoder, self.embedding = PositionalEncoding(ninp), nn.Embedding(vocab, ninp)
            self.transformer = nn.Transformer(d_model=ninp, nhead=nhead, num_encoder_layers=nlayers,
                                              num_decoder_layers=nlayers, dim_feedforward=nhid, dropout=0.2,
                                              batch_first=True)
            self.decoder, self.ninp, self.vocab = nn.Linear(ninp, vocab), ninp, vocab

        def forward(self, inputs, target):
            t = inputs.shape[1]
            mask = torch.tril(torch.ones(t, t, device=inputs.device)) == 1
            mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, 0.0)
            src = self.pos_encoder(self.embedding(inputs) * math.sqrt(self.ninp))
            tgt = self.pos_encoder(self.embedding(target) * math.sqrt(self.ninp))
            # The demo leaves nn.Transformer to find that the mask is causal by comparing its values, which fake
            # tensors do not hold: say what that comparison finds.
            out = self.decoder(self.transformer(src, tgt, tgt_mask=mask, tgt_is_causal=True))
            return F.log_softmax(out, dim=-1).view(-1, self.vocab)

    return Transformer(**sizes)


@dataclass
class Case:
    name: str
    source: str
    measured_gib: float
    kind: str                    # "reserved" (torch.cuda.max_memory_reserved) or "active" (max_memory_allocated)
    setting: dict
    tolerance: float             # |estimate / measured - 1| allowed
    why: str                     # the reason for the tolerance
    model: object = field(default=None, repr=False)
    in_ci: bool = True           # False: benchmarks/published.py holds it to its tolerance (too slow for CI)

    def train_setting(self) -> TrainSetting:
        return TrainSetting(model=self.model(), **self.setting)


_LIGHTNING = ("Lightning's guide 'Train models with billions of parameters using FSDP' (docs/source-pytorch/advanced/"
              "model_parallel/fsdp.rst, the sharding-strategy table: A100 40GB, Lightning 2.1, PyTorch 2.1); its "
              "'Memory (MB)' is the peak of torch.cuda.memory_summary() (allocated), read as MiB")
_LIGHTNING_SETTING = dict(world_size=2, seq_len=35, batch_size=1, precision="fp32", optimizer="adam")


def _lightning_spec() -> str:
    return "fsdplab.memory.published:lightning_transformer"


_TORCHTITAN = ("torchtitan docs/performance.md, tables 1 and 3 (torchtitan 9dec370, torch 1963fc8, December 2024; "
               "H100 96 GB; memory is torchtitan's logged max_reserved_gib)")
_TITAN_SETTING = dict(seq_len=8192, batch_size=2, precision="bf16", activation_checkpointing="selective",
                      embed_head_units=True, attention="sdpa")

CASES = [
    Case("torchtitan Llama 3.1 8B, FSDP, 8 GPUs", _TORCHTITAN, 82.4, "reserved",
         dict(world_size=8, **_TITAN_SETTING), 0.12,
         "transformers' Llama is traced, not torchtitan's model code (complex RoPE, fused AdamW); and at 8 GPUs the "
         "real run holds about 5 GiB more that scales with 1/N than the traced step does at its peak (the open part "
         "of the 8-against-128 difference, docs/estimator.md)", llama31_8b),
    Case("torchtitan Llama 3.1 8B, FSDP, 128 GPUs", _TORCHTITAN, 67.0, "reserved",
         dict(world_size=128, **_TITAN_SETTING), 0.06,
         "transformers' Llama is traced, not torchtitan's model code; the allocator model assigns streams by tensor "
         "kind", llama31_8b),
    Case("Lightning 1B Transformer, torch DDP, 2 GPUs", _LIGHTNING, 23125 / 1024, "active",
         dict(strategy="ddp", **_LIGHTNING_SETTING), 0.02,
         "the guide's program itself: torch's DDP (its gradient buckets modelled, fsdplab.memory.ddp), fp32, Adam",
         _lightning_spec),
    Case("Lightning 1B Transformer, FSDP1 FULL_SHARD, 2 GPUs", _LIGHTNING, 9627 / 1024, "active",
         dict(strategy="fsdp1_full_shard", **_LIGHTNING_SETTING), 0.03,
         "FSDP1 itself, traced on CPU: the GPU's separate streams for all-gathers and reduce-scatters are not seen "
         "(see SHARD_GRAD_OP in docs/estimator.md)", _lightning_spec, in_ci=False),
    Case("Lightning 1B Transformer, FSDP1 NO_SHARD, 2 GPUs", _LIGHTNING, 19296 / 1024, "active",
         dict(strategy="fsdp1_no_shard", **_LIGHTNING_SETTING), 0.03,
         "FSDP1 itself, traced on CPU (as FULL_SHARD)", _lightning_spec, in_ci=False),
]


def compare(case: Case, progress=False) -> dict:
    """The estimate of `case`: its active peak, the allocator model's reserved, and the errors against the
    published figure."""
    from .exact import estimate

    report = estimate(case.train_setting(), progress=progress)
    predicted = report.gpu_view["reserved"] if case.kind == "reserved" else report.peak_bytes
    return {"case": case.name, "measured_gib": case.measured_gib, "kind": case.kind,
            "active_gib": report.peak_bytes / GIB, "reserved_gib": report.gpu_view["reserved"] / GIB,
            "active_error": report.peak_bytes / GIB / case.measured_gib - 1,
            "error": predicted / GIB / case.measured_gib - 1, "tolerance": case.tolerance,
            "seconds": report.seconds}


def table(rows: list) -> str:
    lines = ["| case | measured (GiB) | active peak estimate | error | reserved estimate | error | tolerance |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['measured_gib']:.1f} {r['kind']} | {r['active_gib']:.2f} | "
                     f"{r['active_error']:+.1%} | {r['reserved_gib']:.2f} | {r['error']:+.1%} | "
                     f"±{r['tolerance']:.0%} |")
    return "\n".join(lines)
