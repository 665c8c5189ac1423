"""One typed source of truth for configuration.

Frozen dataclasses, one per TOML section. Every field carries its comment in
``metadata["help"]`` (the config reference in docs/configuration.md and
``dtrain config`` print it). Files are loaded with :func:`load_config`,
``--set section.field=value`` overrides are applied on top, and the whole thing
is validated once, at load time, with errors that name the file, the section
and the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from dtrain import schema
from dtrain.codec import CODEC_BITS, MAX_CHUNK, Bits, kept_per_chunk, sparse_scheme

REPO_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
_OTLP_ENDPOINT = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}/?")
ISLAND_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # what an island may be called (Join's name)
# An island's identity under security.identity "token" or "cert" (dtrain/identity.py makes them): its token's name
# in security.island_tokens, its client certificate's first URI SAN, or, with none, its certificate's CN.
IDENTITY_KINDS = ("token", "uri", "cn")


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the field."""


def _f(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


CODEC_NAMES = (*CODEC_BITS, "sparse")  # codec.up / codec.down: the dense codecs by their bits, and sparse

@dataclass(frozen=True)
class RunConfig:
    name: str = _f("", "run name; outputs go to OUT_DIR/NAME (empty: the config file's stem)")
    out_dir: str = _f("runs", "folder that holds one subfolder per run")
    seed: int = _f(0, "seed for parameter init and data shuffling")
    log_every: int = _f(50, "inner steps between progress lines and train-loss events")
    eval_every: int = _f(0, "train: inner steps between evals (0: only at the end); simulate evaluates every round")
    checkpoint_every: int = _f(0, "train: inner steps between orbax checkpoints (0: only at the end)")
    keep_checkpoints: int = _f(2, "how many checkpoints to keep on disk")


@dataclass(frozen=True)
class ModelConfig:
    kind: str = _f("gpt", "model family: gpt (a byte GPT: learned positions, LayerNorm, GELU MLP), llama (Hugging "
                   "Face's LlamaForCausalLM: RoPE, RMSNorm, SwiGLU, grouped-query attention) or mlp (a bigram MLP for "
                   "tests)",
                   choices=("gpt", "llama", "mlp"))
    vocab_size: int = _f(256, "vocabulary size (256 = raw bytes; a tokenizer's size for a token store, e.g. 128256 "
                         "for Llama 3's)")
    seq_len: int = _f(64, "tokens per training sequence (context length)")
    d_model: int = _f(64, "residual width")
    n_layers: int = _f(2, "transformer blocks (gpt) or hidden layers (mlp)")
    n_heads: int = _f(4, "attention heads; must divide d_model")
    mlp_ratio: int = _f(4, "gpt: MLP hidden width as a multiple of d_model (the llama ignores it: model.mlp_hidden)")
    dtype: str = _f("float32", "compute dtype; parameters are always kept in float32",
                    choices=("float32", "bfloat16"))
    attention: str = _f("xla", "gpt, llama: the attention kernel: jax.nn.dot_product_attention's xla or cudnn (fused "
                        "flash attention: NVIDIA GPUs, bfloat16, head size a multiple of 8) implementation, or einsum "
                        "(written out, a reference); how the model computes, not what: not in the fingerprint",
                        choices=("xla", "cudnn", "einsum"))
    remat: bool = _f(False, "gpt, llama: recompute each block's activations in the backward pass instead of keeping "
                     "them (less memory, about a third more FLOPs); not in the fingerprint")
    n_kv_heads: int = _f(0, "llama: key/value heads of grouped-query attention, dividing n_heads (0: n_heads, "
                         "multi-head attention); the other kinds reject a value other than the default")
    mlp_hidden: int = _f(0, "llama: SwiGLU hidden width (0: Llama's rule, int(8 * d_model / 3) rounded up to a "
                         "multiple of 256); the other kinds reject a value other than the default")
    rope_theta: float = _f(10000.0, "llama: rotary position embedding base (Llama 2: 10000, Llama 3: 500000; no "
                           "rope scaling); the other kinds reject a value other than the default")
    norm_eps: float = _f(1e-5, "llama: RMSNorm epsilon; the other kinds reject a value other than the default")
    tie_embeddings: bool = _f(False, "llama: the head is the token table (logits = x @ embedding.T, no head "
                              "parameter); the other kinds reject a value other than the default")
    init_from: str = _f("", "a Hugging Face model folder (safetensors weights) whose tensors are θ_0 instead of "
                        "run.seed's initialization: llama from LlamaForCausalLM, gpt from GPT2LMHeadModel, every "
                        "name and shape checked against this [model] first (docs/models.md); read where θ_0 is made "
                        "(the coordinator; dtrain train and simulate --inprocess), not by islands, which receive "
                        "θ_0 from the coordinator: not in the fingerprint")


@dataclass(frozen=True)
class DataConfig:
    source: str = _f("builtin", "a token store (a folder made by `dtrain tokenize`, or a file://, gs://, s3:// "
                     "or http(s):// URL), or 'builtin' (the interpreter's standard-library sources), a text file, "
                     "a folder of text files, or a .bin uint16 token shard / folder of shards: these become a "
                     "byte-tokenized store under data.cache on first use")
    max_bytes: int = _f(8_000_000, "use at most this many tokens of the source, from its start (0: all of it)")
    tokenizer: str = _f("bytes", "how a text source (builtin, text files) becomes a store: 'bytes' (one id per byte, "
                        "vocabulary 256), 'bpe:N' (a byte-level BPE of N ids trained on the source, written into "
                        "the store), or a tokenizer.json path; set model.vocab_size to cover it")
    cache: str = _f("", "where non-store sources become token stores (default: OUT_DIR/data-cache, shared by the "
                    "runs there); a store is reused while its source files are unchanged")
    eval_fraction: float = _f(0.05, "tail fraction of the corpus held out for eval loss")
    eval_batches: int = _f(8, "batches of the held-out split averaged for one eval")
    read_timeout_s: float = _f(60.0, "how long one read of the token store (its manifest, a block of ids) may wait "
                               "before the island stops with an error naming the store")


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = _f(16, "sequences per inner step per island (split over the island's devices)")
    steps: int = _f(400, "inner steps per island for the whole run (sets the lr schedule length)")
    lr: float = _f(4e-4, "peak inner AdamW learning rate")
    warmup_steps: int = _f(50, "linear lr warm-up steps")
    min_lr_ratio: float = _f(0.1, "cosine decay floor as a fraction of lr")
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only)")
    b1: float = _f(0.9, "AdamW beta1")
    b2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "global gradient-norm clip (0: off)")
    steps_per_call: int = _f(10, "inner steps fused into one jitted lax.scan (fewer host round trips)")
    base_batch_size: int = _f(0, "the batch size that train.steps, train.warmup_steps and outer.inner_steps count "
                              "steps of (0: train.batch_size): an island whose train.batch_size differs takes "
                              "steps x base_batch_size / batch_size inner steps for the same tokens (its shard, its "
                              "lr schedule, its step rounds); set it to the run's batch size when islands differ")

    @property
    def base_batch(self) -> int:
        """The batch size the run's step counts are in: ``base_batch_size``, else ``batch_size``."""
        return self.base_batch_size or self.batch_size

    @property
    def shard_sequences(self) -> int:
        """Sequences in each island's shard with step rounds: ``steps`` x :attr:`base_batch` (the same tokens
        whatever an island's own batch size)."""
        return self.steps * self.base_batch

    def island_steps(self, steps: int) -> int:
        """``steps`` of :attr:`base_batch` sequences as this island's steps of ``batch_size`` sequences (the
        same tokens; rounded down, at least 1 for a positive count)."""
        return max(steps * self.base_batch // self.batch_size, 1 if steps > 0 else 0)


@dataclass(frozen=True)
class OuterConfig:
    islands: int = _f(4, "number of islands (replicas) in simulate")
    inner_steps: int = _f(50, "H: inner steps per island between outer steps")
    lr: float = _f(0.7, "outer learning rate (DiLoCo: 0.7)")
    momentum: float = _f(0.9, "outer momentum (DiLoCo: 0.9)")
    nesterov: bool = _f(True, "Nesterov outer momentum")
    rule: str = _f("nesterov", "the outer update: nesterov (DiLoCo: SGD with outer.lr, outer.momentum, "
                   "outer.nesterov) or sparseloco (SparseLoCo: no outer momentum; theta -= outer.sparseloco_lr x "
                   "the mean of the pushes; each island's error feedback decays by outer.sparseloco_beta)",
                   choices=("nesterov", "sparseloco"))
    sparseloco_lr: float = _f(1.0, "sparseloco: outer learning rate applied to the mean of the sparse pushes")
    sparseloco_beta: float = _f(0.95, "sparseloco: decay of each island's error-feedback accumulator "
                                "(e <- beta x e + delta before the top-k), in (0, 1]")
    staleness_alpha: float = _f(0.5, "a delta s versions stale is weighted by (1+s)^-alpha")
    fragments: int = _f(1, "Streaming DiLoCo: theta is cut into this many fragments of whole tensors, each pushed, "
                        "merged and versioned on its own; an island pushes one fragment every outer.inner_steps / "
                        "fragments steps, round robin (1: the whole theta every outer.inner_steps)")


@dataclass(frozen=True)
class MeshConfig:
    data: int = _f(-1, "devices on the 'data' axis (-1: all devices not used by fsdp)")
    fsdp: int = _f(1, "devices on the 'fsdp' axis: parameters and optimizer state are sharded over it")


@dataclass(frozen=True)
class CodecConfig:
    up: str = _f("int8", "codec for pushed pseudo-gradients (sparse: top codec.density of each chunk of "
                 "codec.sparse_chunk values, in codec.sparse_bits bits)", choices=CODEC_NAMES)
    down: str = _f("int8", "codec for the broadcast outer update (fp32: lossless; sparse: the entries the merged "
                   "pushes touched, in codec.sparse_bits bits)", choices=CODEC_NAMES)
    block: int = _f(1024, "values per quantization block (even, 64..65536)")
    zstd_level: int = _f(3, "zstd level for frames (1..19)")
    chunk_bytes: int = _f(1 << 20, "bytes per streamed chunk (4 KiB..4 MiB)")
    error_feedback: bool = _f(True, "keep the quantization residual and add it to the next delta")
    sparse_chunk: int = _f(4096, "sparse codec: values per chunk (even, 64..32768); one scale per chunk")
    density: float = _f(0.02, "sparse codec: fraction of each chunk an island sends (top by magnitude), in (0, 1]; "
                        "the coordinator refuses a push that holds more")
    sparse_bits: int = _f(2, "sparse codec: bits per kept value (2, 4 or 8)", choices=(2, 4, 8))

    def scheme(self, name: str) -> tuple[Bits, int]:
        """The codec scheme and its block for the codec ``name`` (``up`` or ``down``'s value): a dense codec's
        bits and ``block``, or the sparse scheme of ``sparse_bits`` and ``sparse_chunk``."""
        if name == "sparse":
            return sparse_scheme(self.sparse_bits), self.sparse_chunk
        return CODEC_BITS[name], self.block

    @property
    def max_count(self) -> int:
        """Entries a sparse push keeps per chunk (and the most the coordinator accepts)."""
        return kept_per_chunk(self.density, self.sparse_chunk)


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = _f("127.0.0.1", "address the coordinator binds (dtrain coordinator)")
    port: int = _f(50051, "port the coordinator binds (0: any free port)")
    dashboard_port: int = _f(8051, "port of the live dashboard (HTTP, or HTTPS with TLS; the coordinator's token, "
                             "on coordinator.dashboard_host): the page / and /api/status; 0: any free port, also "
                             "taken whenever the coordinator's own port is 0 (dtrain simulate); -1: no dashboard")
    dashboard_host: str = _f("", "address the dashboard binds; empty: coordinator.host. A coordinator that serves "
                             "gRPC on every interface (0.0.0.0) can keep its dashboard on loopback (127.0.0.1), "
                             "reached through an SSH tunnel or kubectl port-forward (deploy/ does)")
    mode: str = _f("sync", "sync: rounds with quorum; async: merge each delta on arrival", choices=("sync", "async"))
    min_quorum: int = _f(0, "sync: pushes that may close a round once grace_s has passed (0: every live island)")
    grace_s: float = _f(30.0, "sync: seconds after a round's first push before a quorum close is allowed")
    lease_s: float = _f(4.0, "an island that sends no heartbeat for this long is lost (4 s with 1 s heartbeats: "
                        "a dead island is found within 4 s, three late heartbeats are forgiven)")
    late_policy: str = _f("discount", "late deltas: apply to the open round with weight (1+s)^-alpha, or drop them "
                          "(always counted)", choices=("discount", "drop"))
    max_staleness: int = _f(4, "deltas more than this many versions old are dropped (counted)")
    keep_updates: int = _f(16, "past compressed updates kept so a lagging island catches up without a full pull")
    max_message_bytes: int = _f(8 << 20, "largest gRPC message accepted (chunks must fit)")
    checkpoint: bool = _f(True, "checkpoint the whole coordinator state with orbax after each merge")
    max_receiving: int = _f(16, "pushes whose frames stream in and are decoded at once; the others wait, their data "
                            "held back by gRPC's flow control (at most stream_window_bytes each): bounds the decoders' "
                            "memory (a few MiB a push) whatever the number of islands; 0: no limit")
    merge_threads: int = _f(2, "threads of the outer step: each reads, decodes and sums every pending push over its "
                            "own slabs of the model, then steps them (numpy and file I/O release the GIL); about "
                            "one per core the coordinator may use for merging")
    workers: int = _f(0, "gRPC server threads for pushes and pulls; 0: 3 per island (outer.islands) + 8, at least 16 "
                      "(an island may hold a push stream, a retry of it and a long-polling pull at once). Joins, "
                      "heartbeats and Status have threads of their own, which no stream can hold")
    stream_idle_s: float = _f(30.0, "a push stream that sends nothing for this long (its header, or its next "
                              "chunk) is cancelled, freeing the server thread it holds; time the coordinator itself "
                              "takes (decoding, max_receiving, a merge) does not count")
    max_streams_per_peer: int = _f(0, "push streams one peer host may hold open at once; more are refused "
                                   "(RESOURCE_EXHAUSTED, retried by workers); 0: outer.islands + 8 (every island of "
                                   "a run may share one host: dtrain simulate, a NAT)")
    max_streams_per_island: int = _f(2, "push streams one island (its headers' island_id) may hold open at once: "
                                     "a push and a retry of it; more are refused (RESOURCE_EXHAUSTED)")
    stream_window_bytes: int = _f(4 << 20, "receive window per incoming stream at most, fixed: bounds the memory "
                                  "pushes in flight hold (islands x window); over a WAN set it >= per-island "
                                  "bandwidth x RTT; 0: gRPC's auto-tuning (BDP probing), unbounded")
    stream_budget_bytes: int = _f(64 << 20, "what all islands' frame streams may hold in the coordinator at once, "
                                  "each way: an island's share is this / outer.islands (at least 64 KiB, at most "
                                  "stream_window_bytes); an incoming stream's receive window is its share, an "
                                  "outgoing pull's chunks half of it (at most codec.chunk_bytes): memory stays "
                                  "flat however many islands there are. Set it >= the coordinator's link "
                                  "bandwidth x RTT; 0: stream_window_bytes windows, codec.chunk_bytes chunks")
    pull_cache_bytes: int = _f(64 << 20, "the chunk messages of the frames pulls serve, kept in memory so each "
                               "frame is read, CRC'd and chunked once, not once per island pulling it; the least "
                               "recently pulled go first, a larger frame streams from disk; 0: none")
    max_push_steps: int = _f(0, "most inner steps one push may cover: its tokens must be <= its cursor range x "
                             "model.seq_len, the range <= this x train.batch_size sequences (0: outer.inner_steps "
                             "/ outer.fragments with step rounds; no cap with wall-time rounds, where it is worth "
                             "setting)")
    merge_rule: str = _f("auto", "how the pushes of a round are combined, per coordinate: the token-weighted mean, "
                         "a trimmed mean or the median (both unweighted), the token-weighted mean of the pushes "
                         "each clipped to clip_ratio x the median L2 norm of the round's pushes, or screened_mean: "
                         "the token-weighted mean of the pushes whose direction agrees with the round's (cosine "
                         ">= min_cosine with the coordinate median of the round's pushes; the others are rejected) "
                         "(docs/faults.md has the measured cost of each); auto: screened_mean, or clipped_mean with "
                         "a sparse codec.up (a per-coordinate median or trim of sparse pushes drops the entries "
                         "only one push holds) or coordinator.shards > 1 (no direction screen there yet)",
                         choices=("auto", "mean", "trimmed_mean", "median", "clipped_mean", "screened_mean"))
    trim: int = _f(1, "trimmed_mean: values dropped at each end of every coordinate (at most (pushes-1)//2)")
    clip_ratio: float = _f(1.0, "clipped_mean: a push's L2 norm is clipped to this multiple of the median norm of "
                           "the round's pushes")
    min_cosine: float = _f(0.0, "screened_mean: when a round of 3 or more pushes closes, a push whose cosine with "
                           "the coordinate median of the round's pushes is below this is rejected (quarantined): "
                           "honest deltas point the same way, a reversed one away; in [-1, 1)")
    probation_min_cosine: float = _f(-0.15, "screened_mean, a run of fewer than 3 islands: a push from an island "
                                     "whose last push was rejected is rejected if its cosine with the outer "
                                     "momentum is below this (honest deltas late in a run are all but orthogonal "
                                     "to it, -0.08 to 0.12 measured); with 3 islands or more, such a push in a "
                                     "round of fewer than 3 pushes is rejected whatever its cosine; in [-1, 1)")
    round_norm_ratio: float = _f(4.0, "when a round closes, a push whose L2 norm exceeds this multiple of the median "
                                 "norm of the round's pushes is rejected (quarantined), from the first round on "
                                 "(rounds of 3 or more pushes); 0: off")
    norm_z_max: float = _f(8.0, "a push whose L2 norm is more than this many robust deviations above the median of "
                           "the recent accepted norms is rejected (quarantined); in a sync round of 3 pushes or "
                           "more, judged when the round closes with the round's own norms beside them (honest "
                           "norms growing together move the median); 0: off")
    norm_max_ratio: float = _f(10.0, "a push whose L2 norm exceeds this multiple of the L2 norm of θ is rejected "
                               "(quarantined), from the first round on (while θ is not 0); 0: off")
    norm_window: int = _f(8, "how many recent accepted push norms the outlier check compares against (a short "
                          "window follows the honest norms as they shrink)")
    norm_window_min: int = _f(4, "the outlier check applies once the window holds this many norms")
    clip_norm: float = _f(0.0, "> 0: a push whose L2 norm exceeds this is scaled down to it (through its merge "
                          "weight); 0: off")
    max_rejections: int = _f(3, "an island whose pushes are rejected this many times in a row is itself quarantined: "
                             "told to stop (in the answer to its push, and its heartbeats), its pushes and Joins "
                             "refused, its shard rerouted to the others; 0: never")
    reject_backoff_s: float = _f(1.0, "after a rejected push, the island's next push is refused (before its payload "
                                 "streams in) for this many seconds, doubled with each rejection in a row; 0: off")
    eval_every: int = _f(5, "evaluate the global θ on the held-out split every this many versions (θ_0 and the "
                         "final version too): an island that pulls such a version evaluates it and reports it "
                         "in a heartbeat (an `eval` event), the evals spread over the live islands (an eval is "
                         "time an island does not train); 0: only the final version")
    refusal_events: int = _f(20, "refused calls (Joins, heartbeats, pushes, pulls; a wrong token has its own limit): "
                             "the first this many of a kind (method and status code) each minute are each an event "
                             "and a progress line, the rest one `refusals_suppressed` event with their count; all "
                             "are counted in Status' refusals")
    forget_after_s: float = _f(3600.0, "a lost island's record is dropped from the coordinator's state (Status, "
                               "/api/status, its checkpoint) this long after its lease ended, unless a push of "
                               "its is pending; its events stay, and under its name it can still join again (a new "
                               "record; shards and data cursors are unaffected); 0: never")
    shards: int = _f(1, "coordinator shards S: theta is cut into S contiguous ranges of whole tensors (the plan of "
                     "outer.fragments), each merged by its own coordinator process (dtrain coordinator --shard I "
                     "--shards S); shard 0, the lead, also holds membership, leases, cursors and the rounds "
                     "(docs/architecture.md#shards); 1: one coordinator")
    shard_addresses: tuple[str, ...] = _f((), "shards > 1: HOST:PORT of coordinator shards 1..S-1, in order, as the "
                                          "lead and the islands reach them (the lead tells the islands at Join)")
    shard_secret_file: str = _f("", "shards > 1: file holding the secret the lead presents to the other shards "
                                "(their Shard service refuses any call without it); every shard reads the same file")

    @property
    def dashboard_address(self) -> str:
        """The address the dashboard binds: ``dashboard_host``, else ``host``."""
        return self.dashboard_host or self.host


@dataclass(frozen=True)
class WorkerConfig:
    overlap: bool = _f(True, "keep training while a push/pull is in flight; fold the new θ in on arrival")
    max_overlap_steps: int = _f(5, "with overlap: inner steps an island may take past a push before it waits "
                                "for the new θ (Streaming DiLoCo: tau <= 5; larger trades quality for idle time); "
                                "with round_seconds = auto, every island may train on past a push for this share "
                                "of outer.inner_steps of the round (and at least this many of its own steps)")
    round_seconds: float = _f(0.0, "> 0: a round is this many seconds of training (H differs per island); "
                              "0: outer.inner_steps steps; 'auto' (-1): wall-time rounds in which the islands together "
                              "train the tokens of outer.inner_steps steps of train.base_batch_size sequences per "
                              "island (so train.steps / outer.inner_steps rounds train the run's tokens), from the "
                              "islands' token rates measured in round 1's training (round 1 lasts until every "
                              "island has one; an island that joins later takes the run's length); in sync mode "
                              "the coordinator then paces each later round so the run merges that many tokens")
    start_wait_s: float = _f(60.0, "before the first step, wait up to this long for outer.islands islands to "
                             "have joined, so round 1 starts together (0: start at once)")
    heartbeat_s: float = _f(1.0, "seconds between heartbeats (at most half of coordinator.lease_s)")
    rpc_deadline_s: float = _f(60.0, "deadline of one RPC")
    retry_initial_s: float = _f(0.2, "first retry backoff on UNAVAILABLE (and DEADLINE_EXCEEDED, a busy "
                                "coordinator's RESOURCE_EXHAUSTED)")
    retry_max_s: float = _f(5.0, "backoff ceiling")
    retry_total_s: float = _f(600.0, "give up after retrying this long (a coordinator outage longer than this)")
    compile_cache: str = _f("", "folder of JAX's persistent compilation cache: a start of the island (a restart "
                            "above all) loads the programs an earlier start compiled instead of compiling them "
                            "again; '': compile-cache in the island's folder (`dtrain worker --run-dir`; `dtrain "
                            "simulate` gives its islands RUN_DIR/compile-cache, which they share); 'off': none, "
                            "every start compiles")


ROUND_AUTO = -1.0  # worker.round_seconds = "auto", as stored

# Settings an island may have of its own (`dtrain worker --set`, `dtrain simulate --island NAME:...`): how it
# computes, not what; never a fingerprint field (Config.fingerprint_fields), which every island must share.
PER_ISLAND_FIELDS = ("train.batch_size", "train.steps_per_call", "model.attention", "model.remat",
                     "worker.round_seconds", "outer.inner_steps", "worker.overlap", "worker.max_overlap_steps",
                     "mesh.data", "mesh.fsdp", "health.enabled")


@dataclass(frozen=True)
class HealthConfig:
    enabled: bool = _f(False, "island workers run the per-device inner step and the chip-health probes, and "
                       "quarantine a device found faulty (workers/chip_health.py)")
    known_answer_every: int = _f(100, "inner steps between known-answer probes on every device (also run at start "
                                 "and after a chunk raised; 0: only then); the replay, every replay_every steps, "
                                 "sees a device computing wrong too")
    stats: bool = _f(True, "compare the devices' micro-batch gradient norms from the per-device step (robust "
                     "z-score); a device flagged on two consecutive checks is quarantined")
    z_max: float = _f(6.0, "stats: a device whose gradient norm is more than this many robust deviations from "
                      "the median is an outlier")
    replay_every: int = _f(50, "inner steps between deterministic replays: a row of one device's micro-batch (each "
                           "device's in turn) recomputed on every healthy device, whose bit-exact digests must "
                           "agree; a device outside a strict majority is quarantined (one due mid-chunk runs at the "
                           "chunk's end: 50 finds a silent fault within 50 steps with chunks of 10 or 25; 0: off)")
    min_devices: int = _f(1, "the fewest healthy devices an island trains on; below it the island drains")


@dataclass(frozen=True)
class SecurityConfig:
    token_env: str = _f("DTRAIN_TOKEN", "environment variable with the bearer token ('' or unset: no auth)")
    ca: str = _f("", "PEM CA bundle: workers verify the coordinator with it; with client_auth, the "
                 "coordinator verifies workers")
    server_cert: str = _f("", "coordinator TLS certificate (PEM); empty: plaintext (loopback/testing only)")
    server_key: str = _f("", "coordinator TLS private key (PEM)")
    client_cert: str = _f("", "worker certificate for mutual TLS (PEM)")
    client_key: str = _f("", "worker private key for mutual TLS (PEM)")
    client_auth: bool = _f(False, "mutual TLS: the coordinator requires a client certificate signed by ca")
    server_name: str = _f("", "TLS name to expect on the coordinator's certificate (empty: the host)")
    identity: str = _f("shared", "who an island is: 'shared' (one token or certificate for a single trusted team: any "
                       "holder may act as any island), 'token' (each island its own token, listed hashed in "
                       "island_tokens) or 'cert' (mutual TLS: the island's client certificate, its URI SAN or CN); "
                       "with token or cert, an island name is bound to the identity that first joined with it",
                       choices=("shared", "token", "cert"))
    island_tokens: str = _f("", "identity 'token', the coordinator: file of 'NAME sha256:HEX' lines, one per island "
                            "(`dtrain admin issue-token NAME` makes one); a token acts only as its NAME")
    bindings: tuple[str, ...] = _f((), "identity token or cert: NAME=IDENTITY pins, the operator's re-binding "
                                   "(IDENTITY: token:NAME, uri:URI or cn:CN); a pin overrides the binding a name "
                                   "got at its first Join")


@dataclass(frozen=True)
class TelemetryConfig:
    exporter: str = _f("none", "where OpenTelemetry spans and metrics go: none (off), console (stderr), otlp (a "
                       "collector over gRPC; needs pip install 'dtrain[otlp]'), memory (kept in the process, for "
                       "tests)", choices=("none", "console", "otlp", "memory"))
    otlp_endpoint: str = _f("http://127.0.0.1:4317", "otlp: the collector's OTLP/gRPC endpoint, http://HOST:PORT "
                            "(plaintext) or https://HOST:PORT (TLS)")
    otlp_timeout_s: float = _f(5.0, "otlp: seconds one export may take, retries included (also bounds the "
                               "flush at shutdown)")
    export_interval_s: float = _f(10.0, "console and otlp: seconds between metric exports")
    service_name: str = _f("dtrain", "prefix of the OpenTelemetry service.name: PREFIX-coordinator, PREFIX-island")


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    @property
    def rounds(self) -> int:
        """Outer rounds per island: ceil(train.steps / outer.inner_steps) (one round when H = steps); with
        outer.fragments F, a round (one fragment's push and merge) every H / F steps: ceil(train.steps / (H / F))."""
        return math.ceil(self.train.steps / (self.outer.inner_steps // self.outer.fragments))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section as plain TOML/JSON types (a tuple field, such as security.bindings, as a list)."""
        return {name: {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
                for name, section in dataclasses.asdict(self).items()}

    def fingerprint_fields(self) -> dict[str, str]:
        """What must match between the coordinator and every island: model shapes, dtype, codecs (with a sparse codec
        or the sparseloco rule, also the sparse codec's fields and the rule with its β; not the model's
        compute knobs, :data:`COMPUTE_ONLY_MODEL_FIELDS`: a GPU island with cuDNN attention and a TPU island without
        train the same model; nor where θ_0 comes from, :data:`THETA0_ONLY_MODEL_FIELDS`; nor, for another kind, the
        llama-only fields, held at their defaults: a GPT's fingerprint is what it was before the llama came)."""
        skip = COMPUTE_ONLY_MODEL_FIELDS + THETA0_ONLY_MODEL_FIELDS + \
            (LLAMA_ONLY_MODEL_FIELDS if self.model.kind != "llama" else ())
        fields = {f"model.{k}": str(v) for k, v in dataclasses.asdict(self.model).items() if k not in skip}
        fields.update({f"codec.{k}": str(getattr(self.codec, k)) for k in ("up", "down", "block")})
        if "sparse" in (self.codec.up, self.codec.down) or self.outer.rule != "nesterov":
            # only then: every other run's fingerprint stays what it was before the sparse codec came
            fields.update({f"codec.{k}": str(getattr(self.codec, k)) for k in ("sparse_chunk", "sparse_bits",
                                                                              "density")})
            fields.update({f"outer.{k}": str(getattr(self.outer, k)) for k in ("rule", "sparseloco_beta")})
        if self.outer.fragments != 1:  # only then: the fingerprint of a run without fragments stays as it was
            fields["outer.fragments"] = str(self.outer.fragments)
        if self.coordinator.shards != 1:  # the islands cut their pushes and pulls by the same plan
            fields["coordinator.shards"] = str(self.coordinator.shards)
        return fields

    def fingerprint(self) -> str:
        """Hash of :meth:`fingerprint_fields`."""
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


MAX_FRAGMENTS = 64  # outer.fragments at most (dtrain.fragments: each fragment holds one tensor at least)
COMPUTE_ONLY_MODEL_FIELDS = ("attention", "remat")  # [model] fields that change how, not what, the model computes
# [model] fields read only where θ_0 is made (the coordinator); islands receive θ_0 in their first full pull
THETA0_ONLY_MODEL_FIELDS = ("init_from",)
LLAMA_ONLY_MODEL_FIELDS = ("n_kv_heads", "mlp_hidden", "rope_theta", "norm_eps", "tie_embeddings")
MAX_VOCAB_SIZE = 1 << 31  # ids reach the model as int32 (token stores hold uint16 or uint32 ids)

SECTIONS: dict[str, type] = {"run": RunConfig, "model": ModelConfig, "data": DataConfig, "train": TrainConfig,
            "outer": OuterConfig, "mesh": MeshConfig, "codec": CodecConfig, "coordinator": CoordinatorConfig,
            "worker": WorkerConfig, "health": HealthConfig, "security": SecurityConfig,
            "telemetry": TelemetryConfig}


def _build_section(cls: type, values: dict[str, Any], origin: str, section: str) -> Any:
    """One section from its TOML table: field types checked by ``dtrain.schema``, missing fields defaulted."""
    try:
        return schema.load(cls, values, partial=True)
    except schema.SchemaError as e:
        raise ConfigError(f"{origin}: [{section}] {schema.format_path(e.path)}: {e.why}") from None


_Fail = Callable[[str, str, str], NoReturn]  # fail(section, field, why): raises the ConfigError naming the field

# Fields that must be >= 1 and >= 0, checked in this order (their message gives the value).
_AT_LEAST_ONE = [("run", "log_every"), ("run", "keep_checkpoints"), ("model", "vocab_size"), ("model", "seq_len"),
                 ("model", "d_model"), ("model", "n_layers"), ("model", "n_heads"), ("model", "mlp_ratio"),
                 ("data", "eval_batches"), ("train", "batch_size"), ("train", "steps"), ("train", "steps_per_call"),
                 ("outer", "islands"), ("outer", "inner_steps"), ("coordinator", "merge_threads")]
_AT_LEAST_ZERO = [("run", "eval_every"), ("run", "checkpoint_every"), ("data", "max_bytes"),
                  ("train", "warmup_steps"), ("train", "weight_decay"), ("train", "grad_clip"),
                  ("outer", "staleness_alpha")]


def _check_choices(cfg: Config, fail: _Fail) -> None:
    """Every field with ``choices`` in its metadata holds one of them."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            value = getattr(getattr(cfg, section), f.name)
            if choices and value not in choices:
                fail(section, f.name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_signs(cfg: Config, fail: _Fail) -> None:
    """The counts of :data:`_AT_LEAST_ONE` are >= 1, then those of :data:`_AT_LEAST_ZERO` >= 0."""
    for section, name in _AT_LEAST_ONE:
        if getattr(getattr(cfg, section), name) < 1:
            fail(section, name, f"must be >= 1, got {getattr(getattr(cfg, section), name)}")
    for section, name in _AT_LEAST_ZERO:
        if getattr(getattr(cfg, section), name) < 0:
            fail(section, name, f"must be >= 0, got {getattr(getattr(cfg, section), name)}")


def _check_model(cfg: Config, fail: _Fail) -> None:
    """[model]: heads divide the width, cuDNN attention's dtype and head size, the vocabulary fits int32 ids, then
    :func:`_check_llama`."""
    m = cfg.model
    if m.d_model % m.n_heads:
        fail("model", "n_heads", f"must divide d_model ({m.d_model} % {m.n_heads} = {m.d_model % m.n_heads})")
    if m.attention == "cudnn" and m.kind in ("gpt", "llama"):
        if m.dtype != "bfloat16":
            fail("model", "attention", f"cudnn (fused flash attention) needs model.dtype = \"bfloat16\", "
                 f"got {m.dtype!r}")
        if (m.d_model // m.n_heads) % 8:
            fail("model", "attention", f"cudnn needs a head size (d_model / n_heads) that is a multiple of 8, got "
                 f"{m.d_model // m.n_heads}")
    if m.vocab_size > MAX_VOCAB_SIZE:
        fail("model", "vocab_size", f"token ids are int32, so at most {MAX_VOCAB_SIZE}, got {m.vocab_size}")
    if m.init_from and m.kind not in ("llama", "gpt"):
        fail("model", "init_from", f"a Hugging Face folder holds a llama or a gpt, not a {m.kind}")
    _check_llama(cfg, fail)


def _check_llama(cfg: Config, fail: _Fail) -> None:
    """[model]'s llama-only fields: left at their defaults by the other kinds; for the llama, kv heads dividing the
    heads, an even head size (RoPE rotates halves), a positive rope base and norm epsilon, a hidden width >= 0."""
    m, defaults = cfg.model, ModelConfig()
    if m.kind != "llama":
        for name in LLAMA_ONLY_MODEL_FIELDS:
            if getattr(m, name) != getattr(defaults, name):
                fail("model", name, f"only model.kind = \"llama\" has it; {m.kind} needs the default "
                     f"{getattr(defaults, name)!r}, got {getattr(m, name)!r}")
        return
    if m.n_kv_heads < 0 or (m.n_kv_heads and m.n_heads % m.n_kv_heads):
        fail("model", "n_kv_heads", f"must divide n_heads ({m.n_heads}) or be 0 (= n_heads), got {m.n_kv_heads}")
    if (m.d_model // m.n_heads) % 2:
        fail("model", "n_heads", f"the head size d_model / n_heads must be even for rotary embeddings, got "
             f"{m.d_model // m.n_heads}")
    for name in ("rope_theta", "norm_eps"):
        if not (math.isfinite(getattr(m, name)) and getattr(m, name) > 0):
            fail("model", name, f"must be a finite number > 0, got {getattr(m, name)}")
    if m.mlp_hidden < 0:
        fail("model", "mlp_hidden", f"must be >= 0 (0: Llama's rule), got {m.mlp_hidden}")


def _check_optimization(cfg: Config, fail: _Fail) -> None:
    """[data]'s eval split, then the inner ([train]) and outer ([outer]) optimizers' ranges."""
    t, o, d = cfg.train, cfg.outer, cfg.data
    if not 0.0 < d.eval_fraction < 0.5:
        fail("data", "eval_fraction", f"must be in (0, 0.5), got {d.eval_fraction}")
    if not (d.tokenizer == "bytes" or (d.tokenizer.startswith("bpe:") and d.tokenizer[4:].isdigit()
                                       and int(d.tokenizer[4:]) >= 257) or d.tokenizer.endswith(".json")):
        fail("data", "tokenizer", f"must be 'bytes', 'bpe:N' (N >= 257) or a tokenizer.json path, got "
             f"{d.tokenizer!r}")
    if not d.read_timeout_s > 0:
        fail("data", "read_timeout_s", f"must be > 0, got {d.read_timeout_s}")
    if not t.lr > 0:
        fail("train", "lr", f"must be > 0, got {t.lr}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        fail("train", "min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    for name in ("b1", "b2"):
        if not 0.0 <= getattr(t, name) < 1.0:
            fail("train", name, f"must be in [0, 1), got {getattr(t, name)}")
    if t.warmup_steps >= t.steps:
        fail("train", "warmup_steps", f"must be < train.steps ({t.steps}), got {t.warmup_steps}")
    if o.inner_steps > t.steps:  # H > steps would be one round shorter than H: the run's length is train.steps
        fail("outer", "inner_steps", f"must be <= train.steps ({t.steps}), got {o.inner_steps}")
    if not o.lr > 0:
        fail("outer", "lr", f"must be > 0, got {o.lr}")
    if not 0.0 <= o.momentum < 1.0:
        fail("outer", "momentum", f"must be in [0, 1), got {o.momentum}")
    if not o.sparseloco_lr > 0:
        fail("outer", "sparseloco_lr", f"must be > 0, got {o.sparseloco_lr}")
    if not 0.0 < o.sparseloco_beta <= 1.0:
        fail("outer", "sparseloco_beta", f"must be in (0, 1], got {o.sparseloco_beta}")
    _check_fragments(cfg, fail)
    _check_shards(cfg, fail)


def _check_shards(cfg: Config, fail: _Fail) -> None:
    """coordinator.shards: 1..64; more than one only with what a sharded coordinator does (sync rounds, no
    fragments, no direction screen) and a shard secret."""
    co = cfg.coordinator
    if not 1 <= co.shards <= MAX_FRAGMENTS:
        fail("coordinator", "shards", f"must be in 1..{MAX_FRAGMENTS}, got {co.shards}")
    if co.shards == 1:
        return
    if cfg.outer.fragments != 1:
        fail("coordinator", "shards", f"{co.shards} shards with outer.fragments = {cfg.outer.fragments}: a sharded "
             f"coordinator does not exchange fragments yet; set one of them to 1")
    if co.mode != "sync":
        fail("coordinator", "shards", f"needs coordinator.mode = 'sync' (every shard commits each version "
             f"together), got {co.mode!r}")
    if co.merge_rule == "screened_mean":
        fail("coordinator", "merge_rule", "screened_mean with coordinator.shards > 1: the direction screen is not "
             "built for a sharded coordinator yet; use clipped_mean (what auto takes there), mean, trimmed_mean or "
             "median")
    if not co.shard_secret_file:
        fail("coordinator", "shard_secret_file", f"coordinator.shards = {co.shards} needs a file holding the "
             f"secret the lead presents to the other shards")
    if co.shard_addresses and len(co.shard_addresses) != co.shards - 1:
        fail("coordinator", "shard_addresses", f"{len(co.shard_addresses)} addresses for {co.shards} shards: give "
             f"shards 1..{co.shards - 1}'s, {co.shards - 1} of them")


def _check_fragments(cfg: Config, fail: _Fail) -> None:
    """outer.fragments: 1..64, dividing outer.inner_steps, with step rounds of a synchronous coordinator (the
    round robin of fragments follows the versions: one merge per round)."""
    o = cfg.outer
    if o.fragments == 1:
        return
    if not 1 <= o.fragments <= MAX_FRAGMENTS:
        fail("outer", "fragments", f"must be in 1..{MAX_FRAGMENTS}, got {o.fragments}")
    if o.inner_steps % o.fragments:
        fail("outer", "fragments", f"must divide outer.inner_steps ({o.inner_steps}), got {o.fragments}")
    if cfg.coordinator.mode != "sync":
        fail("outer", "fragments", f"needs coordinator.mode = 'sync' (fragments merge in turn, one per round), "
             f"got {cfg.coordinator.mode!r}")
    if cfg.worker.round_seconds != 0:
        fail("outer", "fragments", "needs step rounds (worker.round_seconds = 0)")


def _check_mesh_and_codec(cfg: Config, fail: _Fail) -> None:
    """[mesh]'s axis sizes, then [codec]'s block, zstd level and chunk size."""
    mesh = cfg.mesh
    if mesh.data == 0 or mesh.data < -1:
        fail("mesh", "data", f"must be >= 1 or -1 (all devices), got {mesh.data}")
    if mesh.fsdp < 1:
        fail("mesh", "fsdp", f"must be >= 1, got {mesh.fsdp}")
    c = cfg.codec
    if c.block % 2 or not 64 <= c.block <= 65536:
        fail("codec", "block", f"must be even and in [64, 65536], got {c.block}")
    if not 1 <= c.zstd_level <= 19:
        fail("codec", "zstd_level", f"must be in [1, 19], got {c.zstd_level}")
    if not 4096 <= c.chunk_bytes <= 4 << 20:
        fail("codec", "chunk_bytes", f"must be in [4096, 4194304], got {c.chunk_bytes}")
    if c.sparse_chunk % 2 or not 64 <= c.sparse_chunk <= MAX_CHUNK:
        fail("codec", "sparse_chunk", f"must be even and in [64, {MAX_CHUNK}], got {c.sparse_chunk}")
    if not 0.0 < c.density <= 1.0:
        fail("codec", "density", f"must be in (0, 1], got {c.density}")


def merge_rule(cfg: Config) -> str:
    """``coordinator.merge_rule`` as the coordinator merges: ``auto`` is the screened mean, or with a sparse
    ``codec.up`` the clipped mean (the pushes' entries rarely coincide, so a per-coordinate median or trim, or a
    screen against the coordinate median, would drop most of them)."""
    rule = cfg.coordinator.merge_rule
    if rule == "auto":  # a sharded coordinator has no direction screen (the median is per range): clipped
        return "clipped_mean" if cfg.codec.up == "sparse" or cfg.coordinator.shards > 1 else "screened_mean"
    return rule


def _check_coordinator(cfg: Config, fail: _Fail) -> None:
    """[coordinator]: ports, rounds, leases, message and stream sizes (message size against codec.chunk_bytes)."""
    co, c = cfg.coordinator, cfg.codec
    if c.up == "sparse" and co.merge_rule in ("median", "trimmed_mean", "screened_mean"):
        fail("coordinator", "merge_rule", f"{co.merge_rule} takes a per-coordinate median or trim, and sparse "
             f"pushes (codec.up = sparse) rarely hold the same entries: it would drop most of them; use "
             f"clipped_mean (or auto)")
    if not 0 <= co.port <= 65535:
        fail("coordinator", "port", f"must be in [0, 65535], got {co.port}")
    if not -1 <= co.dashboard_port <= 65535:
        fail("coordinator", "dashboard_port", f"must be -1 (no dashboard) or in [0, 65535], got {co.dashboard_port}")
    if co.dashboard_port == co.port != 0:
        fail("coordinator", "dashboard_port", f"must differ from coordinator.port ({co.port})")
    if co.dashboard_host != co.dashboard_host.strip() or any(c in co.dashboard_host for c in "/ \t"):
        fail("coordinator", "dashboard_host", f"must be a host name or address (empty: coordinator.host), got "
             f"{co.dashboard_host!r}")
    if co.min_quorum < 0:
        fail("coordinator", "min_quorum", f"must be >= 0, got {co.min_quorum}")
    for name in ("grace_s", "lease_s"):
        if not getattr(co, name) > 0:
            fail("coordinator", name, f"must be > 0, got {getattr(co, name)}")
    if co.max_staleness < 0:
        fail("coordinator", "max_staleness", f"must be >= 0, got {co.max_staleness}")
    if co.keep_updates < 1:
        fail("coordinator", "keep_updates", f"must be >= 1, got {co.keep_updates}")
    if co.max_message_bytes < c.chunk_bytes + 4096:
        fail("coordinator", "max_message_bytes", f"must exceed codec.chunk_bytes ({c.chunk_bytes}) by 4 KiB, "
             f"got {co.max_message_bytes}")
    if co.workers == 1 or co.workers < 0:
        fail("coordinator", "workers", f"must be 0 (auto) or >= 2, got {co.workers}")
    if not (math.isfinite(co.stream_idle_s) and co.stream_idle_s > 0):
        fail("coordinator", "stream_idle_s", f"must be a finite number > 0, got {co.stream_idle_s}")
    if co.max_streams_per_peer < 0:
        fail("coordinator", "max_streams_per_peer", f"must be 0 (auto) or >= 1, got {co.max_streams_per_peer}")
    if co.max_streams_per_island < 1:
        fail("coordinator", "max_streams_per_island", f"must be >= 1, got {co.max_streams_per_island}")
    if co.refusal_events < 1:
        fail("coordinator", "refusal_events", f"must be >= 1, got {co.refusal_events}")
    if not (math.isfinite(co.forget_after_s) and co.forget_after_s >= 0):
        fail("coordinator", "forget_after_s", f"must be a finite number >= 0 (0: never), got {co.forget_after_s}")
    if co.pull_cache_bytes < 0:
        fail("coordinator", "pull_cache_bytes", f"must be >= 0, got {co.pull_cache_bytes}")
    if co.stream_budget_bytes < 0:
        fail("coordinator", "stream_budget_bytes", f"must be >= 0, got {co.stream_budget_bytes}")
    if co.stream_window_bytes and not 64 << 10 <= co.stream_window_bytes <= 1 << 30:
        fail("coordinator", "stream_window_bytes", f"must be 0 or in [65536, 1073741824], got {co.stream_window_bytes}")


def _check_merge(cfg: Config, fail: _Fail) -> None:
    """[coordinator]'s merge knobs: push caps, trimming, eval cadence and the norm outlier checks."""
    co = cfg.coordinator
    for name in ("max_push_steps", "trim", "eval_every", "max_receiving", "max_rejections"):
        if getattr(co, name) < 0:
            fail("coordinator", name, f"must be >= 0, got {getattr(co, name)}")
    for name in ("norm_z_max", "norm_max_ratio", "clip_norm", "reject_backoff_s"):
        if not (math.isfinite(getattr(co, name)) and getattr(co, name) >= 0):
            fail("coordinator", name, f"must be a finite number >= 0, got {getattr(co, name)}")
    if not (math.isfinite(co.clip_ratio) and co.clip_ratio > 0):
        fail("coordinator", "clip_ratio", f"must be a finite number > 0, got {co.clip_ratio}")
    for name in ("min_cosine", "probation_min_cosine"):
        value = getattr(co, name)
        if not (math.isfinite(value) and -1 <= value < 1):
            fail("coordinator", name, f"must be a finite number in [-1, 1), got {value}")
    if not (math.isfinite(co.round_norm_ratio) and (co.round_norm_ratio == 0 or co.round_norm_ratio > 1)):
        fail("coordinator", "round_norm_ratio", f"must be 0 (off) or a finite number > 1, got {co.round_norm_ratio}")
    if co.norm_window < 1:
        fail("coordinator", "norm_window", f"must be >= 1, got {co.norm_window}")
    if not 1 <= co.norm_window_min <= co.norm_window:
        fail("coordinator", "norm_window_min", f"must be in [1, norm_window={co.norm_window}], "
             f"got {co.norm_window_min}")


def _check_worker(cfg: Config, fail: _Fail) -> None:
    """[worker]: overlap and round lengths, timeouts, and heartbeats at most half of coordinator.lease_s."""
    w, co = cfg.worker, cfg.coordinator
    if w.max_overlap_steps < 0:
        fail("worker", "max_overlap_steps", f"must be >= 0, got {w.max_overlap_steps}")
    if w.round_seconds < 0 and w.round_seconds != ROUND_AUTO:
        fail("worker", "round_seconds", f"must be >= 0 or 'auto', got {w.round_seconds}")
    if w.start_wait_s < 0:
        fail("worker", "start_wait_s", f"must be >= 0, got {w.start_wait_s}")
    for name in ("heartbeat_s", "rpc_deadline_s", "retry_initial_s", "retry_max_s", "retry_total_s"):
        if not getattr(w, name) > 0:
            fail("worker", name, f"must be > 0, got {getattr(w, name)}")
    if w.heartbeat_s > co.lease_s / 2:  # two heartbeats per lease at least: one lost heartbeat loses no island
        fail("worker", "heartbeat_s", f"must be at most half of coordinator.lease_s ({co.lease_s}), "
             f"got {w.heartbeat_s}")


def _check_health(cfg: Config, fail: _Fail) -> None:
    """[health]: probe periods, the outlier threshold and the fewest devices."""
    h = cfg.health
    for name in ("known_answer_every", "replay_every"):
        if getattr(h, name) < 0:
            fail("health", name, f"must be >= 0 (0: off), got {getattr(h, name)}")
    if not (math.isfinite(h.z_max) and h.z_max > 0):
        fail("health", "z_max", f"must be a finite number > 0, got {h.z_max}")
    if h.min_devices < 1:
        fail("health", "min_devices", f"must be >= 1, got {h.min_devices}")


def _check_security(cfg: Config, fail: _Fail) -> None:
    """[security]: certificates come with their keys; mutual TLS has a CA and a server certificate."""
    sec = cfg.security
    if bool(sec.server_cert) != bool(sec.server_key):
        fail("security", "server_key" if sec.server_cert else "server_cert",
             "server_cert and server_key go together")
    if bool(sec.client_cert) != bool(sec.client_key):
        fail("security", "client_key" if sec.client_cert else "client_cert",
             "client_cert and client_key go together")
    if sec.client_auth and not (sec.ca and sec.server_cert):
        fail("security", "client_auth", "mutual TLS needs security.ca and security.server_cert")
    if sec.identity == "token" and not sec.island_tokens:
        fail("security", "island_tokens", "identity 'token' needs the file of the islands' token hashes (`dtrain "
             "admin issue-token NAME` prints a line of it)")
    if sec.identity == "cert" and not sec.client_auth:
        fail("security", "identity", "'cert' reads the islands' client certificates: set security.client_auth "
             "(mutual TLS)")
    if sec.bindings and sec.identity == "shared":
        fail("security", "bindings", "pins bind names to identities: set security.identity to 'token' or 'cert'")
    for i, text in enumerate(sec.bindings):
        try:
            parse_binding(text)
        except ValueError as e:
            fail("security", f"bindings[{i}]", str(e))


def parse_binding(text: str) -> tuple[str, str]:
    """A ``security.bindings`` entry ``NAME=KIND:VALUE`` as (name, identity); ValueError says what is wrong."""
    name, sep, identity = text.partition("=")
    kind, colon, value = identity.partition(":")
    if not sep or not ISLAND_NAME_RE.fullmatch(name.strip()):
        raise ValueError(f"{text!r}: expected NAME=IDENTITY with an island name ([A-Za-z0-9._-]{{1,64}}), e.g. "
                         f"B=token:B or B=uri:spiffe://dtrain/island/B")
    if kind.strip() not in IDENTITY_KINDS or not colon or not value.strip():
        raise ValueError(f"{text!r}: the identity must be {', '.join(k + ':VALUE' for k in IDENTITY_KINDS)}")
    return name.strip(), f"{kind.strip()}:{value.strip()}"


def _check_telemetry(cfg: Config, fail: _Fail) -> None:
    """[telemetry]: export timings, the OTLP endpoint's form (with the otlp exporter), a service name."""
    tel = cfg.telemetry
    for name in ("otlp_timeout_s", "export_interval_s"):
        if not (math.isfinite(getattr(tel, name)) and getattr(tel, name) > 0):
            fail("telemetry", name, f"must be a finite number > 0, got {getattr(tel, name)}")
    if tel.exporter == "otlp" and not _OTLP_ENDPOINT.fullmatch(tel.otlp_endpoint):
        fail("telemetry", "otlp_endpoint", f"must be http://HOST:PORT or https://HOST:PORT, got "
             f"{tel.otlp_endpoint!r}")
    if not tel.service_name.strip():
        fail("telemetry", "service_name", "must not be empty")


def _check_batch_split(cfg: Config, fail: _Fail) -> None:
    """train.batch_size splits evenly over the mesh's fixed devices (mesh.data x mesh.fsdp; data -1 counts 1)."""
    mesh, t = cfg.mesh, cfg.train
    fixed = (mesh.data if mesh.data > 0 else 1) * mesh.fsdp
    if t.batch_size % fixed:
        fail("train", "batch_size", f"{t.batch_size} is not divisible by the mesh's {fixed} devices "
             f"(mesh.data x mesh.fsdp)")
    if t.base_batch_size < 0:
        fail("train", "base_batch_size", f"must be >= 0, got {t.base_batch_size}")
    if t.shard_sequences % t.batch_size:
        fail("train", "batch_size", f"{t.batch_size} does not divide a shard of train.steps x base_batch_size = "
             f"{t.steps} x {t.base_batch} = {t.shard_sequences} sequences")


# The validators in the order they run: the first failure is the one reported.
_VALIDATORS: tuple[Callable[[Config, _Fail], None], ...] = (
    _check_choices, _check_signs, _check_model, _check_optimization, _check_mesh_and_codec, _check_coordinator,
    _check_merge, _check_worker, _check_health, _check_security, _check_telemetry, _check_batch_split)


def _check(cfg: Config, origin: str) -> None:
    """Cross-field validation, one validator per section (or group) in :data:`_VALIDATORS`' order; the first
    failure raises a ConfigError that names the origin, the section and the field."""

    def fail(section: str, name: str, why: str) -> NoReturn:
        raise ConfigError(f"{origin}: [{section}] {name}: {why}")

    for validate in _VALIDATORS:
        validate(cfg, fail)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parses ``section.field=value``; the value is read as a TOML literal, else a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.field=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: the key must be section.field, e.g. train.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts[0], parts[1], value


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, else a bare name like ``tiny`` from the repo's configs/ folder."""
    p = Path(path)
    if p.exists():
        return p
    for candidate in (Path("configs") / f"{p.name}.toml", REPO_CONFIG_DIR / p.name, REPO_CONFIG_DIR / f"{p.name}.toml"):
        if candidate.exists():
            return candidate
    raise ConfigError(f"{path}: config file not found")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Loads a TOML config (or the defaults), applies ``--set`` overrides, validates."""
    raw: dict[str, Any] = {}
    origin = "<defaults>"
    if path is not None:
        p = resolve_config_path(path)
        origin = str(p)
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{origin}: not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"{origin}: cannot read: {e.strerror}") from None
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section [{section}] (known: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: [{section}] must be a table")
    merged = {s: dict(raw.get(s, {})) for s in SECTIONS}
    for text in overrides:
        section, name, value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError(f"--set {text}: unknown section {section!r} (known: {', '.join(SECTIONS)})")
        if typing.get_type_hints(SECTIONS[section]).get(name) is str and not isinstance(value, str):
            value = text.split("=", 1)[1].strip()  # a string field takes the text as typed: --set run.name=2024
        merged[section][name] = value
    where = origin + (" + --set" if overrides else "")
    if merged["worker"].get("round_seconds") == "auto":
        merged["worker"]["round_seconds"] = ROUND_AUTO
    sections = {s: _build_section(cls, merged[s], where, s) for s, cls in SECTIONS.items()}
    cfg = Config(**sections)
    if not cfg.run.name:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=Path(origin).stem if path else "run"))
    _check(cfg, where)
    return cfg


def replace(cfg: Config, **sections: dict[str, Any]) -> Config:
    """Returns cfg with some fields replaced, e.g. ``replace(cfg, train={"steps": 10})``; re-validated."""
    new = {s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()}
    out = dataclasses.replace(cfg, **new)
    _check(out, "<replace>")
    return out


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML, each field with its comment."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cls):
            value = getattr(getattr(cfg, section), f.name)
            lit = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
            lines.append(f"{f.name} = {lit}  # {f.metadata['help']}")
        lines.append("")
    return "\n".join(lines)


def run_path(cfg: Config) -> Path:
    """Where a run writes: OUT_DIR/NAME."""
    return Path(cfg.run.out_dir) / cfg.run.name


def data_cache(cfg: Config) -> Path:
    """Where sources that are not token stores become stores: ``data.cache``, else OUT_DIR/data-cache."""
    return Path(cfg.data.cache).expanduser() if cfg.data.cache else Path(cfg.run.out_dir) / "data-cache"


COMPILE_CACHE_OFF = "off"  # worker.compile_cache: no persistent compilation cache


def reference_markdown() -> str:
    """The config reference table of docs/configuration.md, generated from the dataclasses."""
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    defaults = Config()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section), f.name)
            lit = str(value).lower() if isinstance(value, bool) else json.dumps(value)
            choices = f.metadata.get("choices")
            extra = f" (one of {', '.join(map(str, choices))})" if choices else ""
            rows.append(f"| `{section}.{f.name}` | `{lit}` | {f.metadata['help']}{extra} |")
    return "\n".join(rows)
