"""benchmarks/scale.py's transport floor: the same round's bytes moved by a bare gRPC server, and a frame's zstd
decoding, with nothing else done."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

from _common import RawServer, log, run_concurrently
from _scale_fleet import pulls_at_once

from dtrain.config.sections import Config
from dtrain.errors import DtrainError


def transport_floor(frames: list[bytes], islands: int, rounds: int, pull_bytes: int, cfg: Config,
                    work: Path) -> dict[str, Any]:
    """What moving a round's bytes costs with nothing else done: ``islands`` threads push the same frames in the
    same chunks (``codec.chunk_bytes``) to a bare Python gRPC server in its own process (``_common.RawServer``, the
    coordinator's channel options) and each pulls ``pull_bytes`` (the coordinator's update frame per island) in
    the coordinator's pull pieces (``coordinator.memory.pull_piece``), at most as many at once as the islands
    pull; the server's CPU seconds per round (median of ``rounds``). And the codec's entropy stage: zstd
    decompressing one frame's body as the coordinator does (chunks in, 256 KiB pieces out, nothing kept), CPU
    seconds in this process (median over the pool, at most 3)."""
    import zstandard

    from coordinator.memory import pull_piece
    from dtrain import codec

    chunk, piece = cfg.codec.chunk_bytes, pull_piece(cfg)
    pulling = threading.BoundedSemaphore(pulls_at_once(islands, pull_bytes))
    server = RawServer(work / f"raw-{islands}", cfg.coordinator.max_message_bytes)
    try:
        channels = [server.channel() for _ in range(islands)]
        for ch in channels:  # connected first, as the islands have joined
            server.push(ch, [b"x"], timeout=60)
        cpu, walls = [], []
        for r in range(rounds):
            def island(i: int, r: int = r) -> None:
                frame = frames[(i + r) % len(frames)]
                got = server.push(channels[i], (frame[k:k + chunk] for k in range(0, len(frame), chunk)))
                with pulling:
                    got += server.pull(channels[i], pull_bytes, piece)
                if got != len(frame) + pull_bytes:
                    raise DtrainError(f"the raw gRPC server moved {got} bytes, expected {len(frame) + pull_bytes}")

            c0 = server.cpu_s()
            res = run_concurrently(islands, island)
            cpu.append(server.cpu_s() - c0)
            walls.append(max(t1 for _, t1, _ in res) - min(t0 for t0, _, _ in res))
            log(f"transport floor: {islands} islands, round {r}: {walls[-1]:.2f}s, raw gRPC server {cpu[-1]:.2f} "
                f"CPU s")
        for ch in channels:
            ch.close()
    finally:
        server.stop()
    class Discard:  # zstd's sink: the pieces are dropped (the coordinator checks and spools them)
        def write(self, data: bytes) -> int:
            return len(data)

    head = codec.FrameValidator(None, out=lambda _: None)
    head.feed(frames[0][:codec.HEADER_SIZE])
    stored = head.header is not None and head.header.stored  # no zstd (int8's default): nothing to decode
    decode = []
    for frame in [] if stored else frames[:3]:  # in the pushes' chunks, out in the coordinator's pieces
        body = memoryview(frame)[codec.HEADER_SIZE:]
        t0 = time.process_time()
        writer = zstandard.ZstdDecompressor().stream_writer(Discard(), write_size=1 << 18)  # type: ignore[arg-type]
        for k in range(0, len(body), chunk):
            writer.write(body[k:k + chunk])
        decode.append(time.process_time() - t0)
    return {"islands": islands, "server_cpu_s": statistics.median(cpu), "server_cpu_s_rounds": cpu,
            "wall_s": statistics.median(walls), "pull_bytes": pull_bytes, "chunk_bytes": chunk, "pull_piece": piece,
            "decode_cpu_s": statistics.median(decode) if decode else None, "stored": stored}
