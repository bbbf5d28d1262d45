"""Coverage-CDF figure (paper Fig. 5 style). matplotlib is an optional extra, imported on use."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cords_vllm.lab.fidelity.coverage import CoverageCDF, max_cdf_gap

_TITLES = {"joint": "Joint K||V", "k": "K only", "v": "V only"}


def plot_coverage_cdfs(
    curves: Mapping[str, Mapping[str, CoverageCDF]],
    path: str | Path,
    *,
    reference: tuple[str, str] | None = None,
    title: str | None = None,
    max_distance: float | None = None,
) -> Path:
    """Write a PNG with one panel per feature space and one curve per method.

    Parameters
    ----------
    curves:
        ``{method: {space: CoverageCDF}}`` (e.g. ``{"cords": coverage_curves(...), ...}``); every
        method must have the same spaces.
    path:
        Output file (``.png``); parent directories are created.
    reference:
        ``(ours, theirs)``: annotate ``max (CDF_ours - CDF_theirs)`` and where it occurs in each panel.
    title:
        Figure title.
    max_distance:
        Right end of the x axis; default: the grid's end.

    Returns
    -------
    The written path.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ImportError("plot_coverage_cdfs needs matplotlib "
                          "(from a checkout of cords-vllm: pip install '.[bench]')") from exc

    if not curves:
        raise ValueError("curves: nothing to plot")
    methods = list(curves)
    spaces = list(curves[methods[0]])
    fig, axes = plt.subplots(1, len(spaces), figsize=(4.2 * len(spaces), 3.6), squeeze=False)
    for ax, space in zip(axes[0], spaces, strict=True):
        for method in methods:
            c = curves[method][space]
            ax.plot(c.grid.numpy(), c.cdf.numpy(), label=method, linewidth=1.6)
        if reference is not None:
            gap, at = max_cdf_gap(curves[reference[0]][space], curves[reference[1]][space])
            ax.axvline(at, color="grey", linestyle=":", linewidth=1)
            ax.annotate(f"max dCDF = {gap:.3f}\nat d = {at:.3f}", xy=(0.45, 0.08), xycoords="axes fraction")
        grid_end = float(curves[methods[0]][space].grid[-1])
        ax.set_xlim(0.0, max_distance if max_distance is not None else grid_end)
        ax.set_ylim(0.0, 1.01)
        ax.set_title(_TITLES.get(space, space))
        ax.set_xlabel("cosine distance to nearest kept token")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("CDF over cache tokens")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
