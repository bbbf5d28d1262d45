"""Deterministic synthetic keys/values with the structure of a video's KV cache.

Mirrors the statistics of :mod:`cords_vllm.lab.synthetic.video` one level down, in KV space. A
*frame* here is one temporal patch of the model (``tokens_per_frame`` tokens, one per spatial
position). Each token has a latent content vector; every KV head projects it with its own random
matrices and adds a per-position component (keys carry position, as rotary keys do):

* scenes of ``scene_length`` frames, each with a smooth background (a two-vector ramp over positions)
  and one object covering a run of positions that moves from frame to frame;
* static scenes (``static_fraction``): the object does not move and there is no noise or drift, so
  frames are exact copies of each other;
* moving scenes: a small per-frame drift (lighting) and per-token noise;
* repeated frames (``repeat_fraction``): exact copies of an earlier frame;
* one rare *needle* frame: a flat grey background with a large, saturated square (a distinctive
  latent direction) in the centre positions, unlike anything else in the video.

Because position ``p`` of frame ``t`` and position ``p`` of frame ``t + 1`` show the same place, the
"same spatial token in the next frame" (InfiniPot-V's temporal redundancy) is meaningful: in static
stretches the two are identical, in moving ones they differ where the object moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cords_vllm.utils import cdiv


@dataclass(frozen=True)
class SyntheticKV:
    """Synthetic keys/values and the ground truth of their structure.

    Attributes
    ----------
    keys, values:
        ``[B, H, N, D]`` with ``N = num_frames * tokens_per_frame``; token ``t * T + p`` is spatial
        position ``p`` of frame ``t``. The ``B`` problems are independent draws (seed, seed+1, ...)
        of the same layout.
    tokens_per_frame:
        ``T``.
    frame_scene:
        Scene index of every frame.
    static_scenes:
        Scenes in which nothing moves.
    repeated_frames:
        ``(frame, source)`` pairs: frame is an exact copy of source.
    needle_frames:
        Frames showing the needle (empty when there is none).
    needle_tokens:
        ``bool [N]``: tokens of the needle square.
    object_tokens:
        ``bool [N]``: tokens covered by a scene's object.
    """

    keys: torch.Tensor
    values: torch.Tensor
    tokens_per_frame: int
    frame_scene: tuple[int, ...]
    static_scenes: tuple[int, ...]
    repeated_frames: tuple[tuple[int, int], ...]
    needle_frames: tuple[int, ...]
    needle_tokens: torch.Tensor
    object_tokens: torch.Tensor

    @property
    def num_frames(self) -> int:
        return len(self.frame_scene)

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    def frame_of_token(self) -> torch.Tensor:
        """``long [N]``: frame index of every token."""
        return torch.arange(self.num_tokens) // self.tokens_per_frame


def make_synthetic_kv(
    num_frames: int = 32,
    tokens_per_frame: int = 16,
    num_heads: int = 2,
    head_dim: int = 32,
    *,
    batch: int = 1,
    seed: int = 0,
    scene_length: int = 4,
    static_fraction: float = 0.3,
    repeat_fraction: float = 0.1,
    needle: bool = True,
    needle_position: float | None = None,
    object_size: int | None = None,
    noise: float = 0.05,
    latent_dim: int = 16,
    dtype: torch.dtype = torch.float32,
) -> SyntheticKV:
    """Generate structured synthetic KV (same arguments -> same tensors, on any machine).

    Parameters
    ----------
    num_frames, tokens_per_frame:
        Frames (temporal patches) and tokens per frame ``T``.
    num_heads, head_dim:
        KV heads ``H`` and head dim ``D``.
    batch:
        Independent problems ``B`` (seeds ``seed .. seed + B - 1``, same layout of scenes/needle).
    seed:
        Seed of every random choice.
    scene_length:
        Frames per scene.
    static_fraction:
        Probability that a scene is static.
    repeat_fraction:
        Fraction of frames replaced by an exact copy of an earlier frame.
    needle, needle_position:
        Whether to insert the needle frame, and where (relative position in ``[0, 1)``, random if None).
    object_size:
        Positions covered by a scene's object (default ``T // 4``, at least 1).
    noise:
        Per-token latent noise in moving scenes (the per-frame drift is ``2 * noise``).
    latent_dim:
        Dimension of the latent content.
    dtype:
        Output dtype (generated in float32).
    """
    _check_kv_args(num_frames, tokens_per_frame, num_heads, head_dim, batch, scene_length, static_fraction,
                   repeat_fraction, needle_position, noise)
    n_pos = tokens_per_frame
    size = max(1, min(n_pos, object_size if object_size is not None else n_pos // 4))
    layout = _draw_layout(num_frames, n_pos, seed, scene_length, static_fraction, repeat_fraction, needle,
                          needle_position)
    needle_tokens = torch.zeros(num_frames * n_pos, dtype=torch.bool)
    for f in layout.needle_frames:
        needle_tokens[f * n_pos:(f + 1) * n_pos] = layout.needle_pos
    object_tokens = torch.zeros(num_frames, n_pos, dtype=torch.bool)

    keys_out, values_out = [], []
    for b in range(batch):
        g = torch.Generator().manual_seed(seed * 1000003 + b + 1)
        latent = _draw_latent(layout, g, size, noise, latent_dim, object_tokens if b == 0 else None)
        k, v = _project(latent, g, num_heads, head_dim)
        keys_out.append(k)
        values_out.append(v)

    return SyntheticKV(
        keys=torch.stack(keys_out).to(dtype),
        values=torch.stack(values_out).to(dtype),
        tokens_per_frame=n_pos,
        frame_scene=layout.frame_scene,
        static_scenes=tuple(int(i) for i in torch.nonzero(layout.static).flatten().tolist()),
        repeated_frames=tuple(layout.repeats),
        needle_frames=layout.needle_frames,
        needle_tokens=needle_tokens,
        object_tokens=object_tokens.reshape(-1),
    )


def _check_kv_args(num_frames: int, tokens_per_frame: int, num_heads: int, head_dim: int, batch: int,
                   scene_length: int, static_fraction: float, repeat_fraction: float, needle_position: float | None,
                   noise: float) -> None:
    """Raise ``ValueError`` naming the first argument of :func:`make_synthetic_kv` out of its range."""
    if num_frames < 1 or tokens_per_frame < 1 or num_heads < 1 or head_dim < 1 or batch < 1:
        raise ValueError("num_frames, tokens_per_frame, num_heads, head_dim and batch must be >= 1")
    if scene_length < 1:
        raise ValueError(f"scene_length: must be >= 1, got {scene_length}")
    for name, value in (("static_fraction", static_fraction), ("repeat_fraction", repeat_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: must be in [0, 1], got {value}")
    if needle_position is not None and not 0.0 <= needle_position < 1.0:
        raise ValueError(f"needle_position: must be in [0, 1), got {needle_position}")
    if noise < 0:
        raise ValueError(f"noise: must be >= 0, got {noise}")


@dataclass(frozen=True)
class _Layout:
    """What every problem of a batch shares: scenes, which are static, repeated frames, the needle, and each
    scene's object start and speed."""

    frame_scene: tuple[int, ...]
    scene_length: int
    static: torch.Tensor
    repeats: list[tuple[int, int]]
    needle_frames: tuple[int, ...]
    needle_pos: torch.Tensor
    starts: torch.Tensor
    speeds: torch.Tensor


def _draw_layout(t_count: int, n_pos: int, seed: int, scene_length: int, static_fraction: float,
                 repeat_fraction: float, needle: bool, needle_position: float | None) -> _Layout:
    """The batch's :class:`_Layout`, drawn from its own generator seeded with ``seed``."""
    layout = torch.Generator().manual_seed(seed)
    n_scenes = cdiv(t_count, scene_length)
    frame_scene = tuple(t // scene_length for t in range(t_count))
    static = torch.rand(n_scenes, generator=layout) < static_fraction
    n_repeat = round(repeat_fraction * t_count)
    repeats: list[tuple[int, int]] = []
    if n_repeat and t_count > 1:
        targets = torch.randperm(t_count - 1, generator=layout)[:n_repeat] + 1
        for f in sorted(targets.tolist()):
            src = int(torch.randint(0, f, (1,), generator=layout))
            repeats.append((f, src))
    needle_frames: tuple[int, ...] = ()
    if needle:
        pos = float(torch.rand(1, generator=layout)) if needle_position is None else needle_position
        needle_frames = (min(int(pos * t_count), t_count - 1),)
        repeats = [(f, s) for f, s in repeats if f not in needle_frames and s not in needle_frames]
    starts = torch.randint(0, n_pos, (n_scenes,), generator=layout)
    speeds = torch.randint(1, max(2, n_pos // 4 + 1), (n_scenes,), generator=layout)

    lo, hi = n_pos // 4, n_pos - n_pos // 4
    needle_pos = torch.zeros(n_pos, dtype=torch.bool)
    needle_pos[lo:max(hi, lo + 1)] = True
    return _Layout(frame_scene, scene_length, static, repeats, needle_frames, needle_pos, starts, speeds)


def _draw_latent(layout: _Layout, g: torch.Generator, size: int, noise: float, lat: int,
                 object_tokens: torch.Tensor | None) -> torch.Tensor:
    """One problem's latent content ``[F, T, L]``: scene backgrounds and objects, drift and noise in moving scenes,
    the repeats and the needle. ``object_tokens`` (``bool [F, T]``, the first problem's), when given, is marked
    where the objects are."""
    t_count, n_pos = len(layout.frame_scene), len(layout.needle_pos)
    n_scenes = len(layout.static)
    ramp = torch.linspace(0.0, 1.0, n_pos)[:, None]  # [T, 1]
    scene_a = torch.randn(n_scenes, lat, generator=g)
    scene_g = torch.randn(n_scenes, lat, generator=g)
    scene_obj = 1.5 * torch.randn(n_scenes, lat, generator=g)
    grey = 0.3 * torch.randn(lat, generator=g)
    needle_vec = 4.0 * torch.randn(lat, generator=g)
    latent = torch.empty(t_count, n_pos, lat)
    for t in range(t_count):
        s = layout.frame_scene[t]
        frame = scene_a[s] + ramp * scene_g[s]  # [T, L]
        k_in_scene = t - s * layout.scene_length
        static = bool(layout.static[s])
        shift = 0 if static else int(layout.speeds[s]) * k_in_scene
        where = (int(layout.starts[s]) + shift + torch.arange(size)) % n_pos
        frame[where] = scene_obj[s]
        if object_tokens is not None:
            object_tokens[t, where] = True
        if not static:
            frame = frame + 2.0 * noise * torch.randn(lat, generator=g)  # per-frame drift
            frame = frame + noise * torch.randn(n_pos, lat, generator=g)  # per-token noise
        latent[t] = frame
    for f, src in layout.repeats:
        latent[f] = latent[src]
        if object_tokens is not None:
            object_tokens[f] = object_tokens[src]
    for f in layout.needle_frames:
        latent[f] = grey
        latent[f, layout.needle_pos] = needle_vec
        if object_tokens is not None:
            object_tokens[f] = False
    return latent


def _project(latent: torch.Tensor, g: torch.Generator, num_heads: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[H, N, D]`` of ``latent``: each KV head's random projection plus a per-position term
    (larger for keys, which carry position as rotary keys do)."""
    t_count, n_pos, lat = latent.shape
    w_k = torch.randn(num_heads, lat, head_dim, generator=g) / lat ** 0.5
    w_v = torch.randn(num_heads, lat, head_dim, generator=g) / lat ** 0.5
    pos_k = 0.5 * torch.randn(num_heads, n_pos, head_dim, generator=g)
    pos_v = 0.1 * torch.randn(num_heads, n_pos, head_dim, generator=g)
    flat = latent.reshape(t_count * n_pos, lat)
    k = torch.einsum("nl,hld->hnd", flat, w_k) + pos_k.repeat(1, t_count, 1)
    v = torch.einsum("nl,hld->hnd", flat, w_v) + pos_v.repeat(1, t_count, 1)
    return k, v
