"""Vectorised numerical kernels of the sigmoid least-squares problem.

Owns the array arithmetic behind ``curve.py``: the squared error's
sufficient statistics on a (C_mid, B) grid, residuals and Jacobian of the
curve in log-compute form, and a projected Levenberg-Marquardt that polishes
many datasets (bootstrap resamples) at once. Knows nothing about settings,
cutoffs or refusals; callers pass validated arrays. The curve is
``R0 + (A - R0) * expit(B * (ln C - ln C_mid))`` with parameters stored as
rows ``theta = (A, B, ln C_mid)``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from scipy.special import expit

FloatArray = npt.NDArray[np.float64]

# Levenberg-Marquardt steps for the bootstrap polish: it starts next to an
# optimum (a grid node or the point estimate) and usually stops far sooner.
NUM_LM_ITERATIONS = 30
# Bound on elements of one sigmoid-table chunk (8 bytes each: 16 MB) so the
# grid statistics never allocate (grid x points) at once.
_CHUNK_ELEMENTS = 2_000_000


def sigmoid_sums(
    log_c: FloatArray,
    log_c_mid: FloatArray,
    log_b: FloatArray,
    weighted_gain: FloatArray,
    weights: FloatArray,
) -> tuple[FloatArray, FloatArray]:
    """Sufficient statistics of the squared error on a (C_mid, B) grid.

    For fixed (C_mid, B) with s_i = expit(B (u_i - m)) and gain a = A - R0,
    ``SSE = sum w y^2 - 2 a sum w y s + a^2 sum w s^2`` (y = R - R0): the
    sums ``S1 = sum w y s`` and ``S2 = sum w s^2`` make every A on the grid
    free. ``weighted_gain`` is w*y and ``weights`` w, both (K, N) for K
    datasets sharing the compute values. Returns S1, S2 of shape (K, nM, nB).
    """
    num_m, num_b, num_points = log_c_mid.size, log_b.size, log_c.size
    b = np.exp(log_b)
    s1 = np.empty((weights.shape[0], num_m, num_b))
    s2 = np.empty_like(s1)
    rows = max(1, _CHUNK_ELEMENTS // (num_b * num_points))
    for start in range(0, num_m, rows):
        stop = min(num_m, start + rows)
        z = b[None, :, None] * (log_c[None, None, :] - log_c_mid[start:stop, None, None])
        s = expit(z)
        s1[:, start:stop] = np.moveaxis(s @ weighted_gain.T, -1, 0)
        s2[:, start:stop] = np.moveaxis((s * s) @ weights.T, -1, 0)
    return s1, s2


def residuals_and_jacobian(
    theta: FloatArray, log_c: FloatArray, y: FloatArray, r0: float
) -> tuple[FloatArray, list[FloatArray]]:
    """Residuals model - data (K, N) and the columns d model / d (A, B, m), for theta rows (K, 3)."""
    a = theta[:, 0:1] - r0
    b = theta[:, 1:2]
    t = log_c[None, :] - theta[:, 2:3]
    s = expit(b * t)
    a_ds = a * s * (1.0 - s)
    residual = r0 + a * s - y
    return residual, [s, a_ds * t, -a_ds * b]


def weighted_sse(theta: FloatArray, log_c: FloatArray, y: FloatArray, w: FloatArray, r0: float) -> FloatArray:
    """Weighted squared error of each row of theta (K, 3) on its dataset (rows of y, w)."""
    s = expit(theta[:, 1:2] * (log_c[None, :] - theta[:, 2:3]))
    residual = r0 + (theta[:, 0:1] - r0) * s - y
    sse: FloatArray = (w * residual * residual).sum(axis=1)
    return sse


def polish_batch(
    theta: FloatArray,
    log_c: FloatArray,
    y: FloatArray,
    w: FloatArray,
    r0: float,
    free: FloatArray,
    lower: FloatArray,
    upper: FloatArray,
) -> tuple[FloatArray, FloatArray]:
    """Projected Levenberg-Marquardt on K weighted datasets at once (theta: K x 3).

    Each dataset stops on its own once converged (``_converged``) and is not stepped again; the loop ends
    when all have, or after ``NUM_LM_ITERATIONS``. A dataset's answer is then the one it converged to: a
    stopped dataset could gain at most a relative 1e-10 of its squared error a step, which moves a fit's
    parameters far below any interval's resolution.
    """
    theta = np.array(theta, dtype=np.float64)
    sse = weighted_sse(theta, log_c, y, w, r0)
    damping = np.full(theta.shape[0], 1e-3)
    fixed_diag = np.diag(1.0 - free)
    active = np.arange(theta.shape[0])
    for _ in range(NUM_LM_ITERATIONS):
        th, ya, wa, damp = theta[active], y[active], w[active], damping[active]
        residual, columns = residuals_and_jacobian(th, log_c, ya, r0)
        weighted = [wa * column * f for column, f in zip(columns, free)]
        # 3x3 normal equations per dataset, built from row sums: einsum over
        # (K, N, 3) is several times slower than these BLAS-free reductions.
        hessian = np.empty((th.shape[0], 3, 3))
        for i in range(3):
            for j in range(i, 3):
                hessian[:, i, j] = hessian[:, j, i] = (weighted[i] * columns[j] * free[j]).sum(axis=1)
        gradient = np.stack([(column * residual).sum(axis=1) for column in weighted], axis=1)
        diag = np.einsum("kii->ki", hessian)
        # Marquardt's scaling by diag(H) makes the step unit-free; the identity
        # on fixed parameters and a tiny ridge keep the system solvable when a
        # column vanishes (e.g. A = R0 makes B and C_mid unidentifiable).
        system = hessian + damp[:, None, None] * (diag[:, :, None] * np.eye(3)) + fixed_diag
        system += 1e-12 * (1.0 + diag.sum(axis=1))[:, None, None] * np.eye(3)
        step = -np.linalg.solve(system, gradient[..., None])[..., 0]
        candidate = np.clip(th + step * free, lower, upper)
        candidate_sse = weighted_sse(candidate, log_c, ya, wa, r0)
        sse_before = sse[active]
        better = candidate_sse < sse_before
        theta[active] = np.where(better[:, None], candidate, th)
        sse[active] = np.where(better, candidate_sse, sse_before)
        damp = np.where(better, damp / 3.0, damp * 4.0)
        damping[active] = damp
        gain = np.where(better, sse_before - candidate_sse, 0.0) / np.maximum(sse_before, 1e-300)
        active = active[~_converged(better, gain, damp)]
        if active.size == 0:
            break
    return theta, sse


def _converged(better: npt.NDArray[np.bool_], gain: FloatArray, damping: FloatArray) -> npt.NDArray[np.bool_]:
    """Datasets that can no longer gain: each either made a negligible improvement (a relative 1e-10 of its
    squared error) or had its step rejected at a damping so large (1e3 x diag(H)) that the step is a tiny
    gradient step."""
    converged: npt.NDArray[np.bool_] = (better & (gain < 1e-10)) | (~better & (damping > 1e3))
    return converged
