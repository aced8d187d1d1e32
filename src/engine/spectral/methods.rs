//! Each spectral method's algorithm (SPEC §4c–§4e) over a tall matrix's row blocks: the Gram
//! matrices and cross products of the short side summed as the rows pass, their
//! eigendecompositions, and the small map ([`RowMap`]) the update is made with. One or two passes
//! over the rows; memory a few n × n matrices, whatever the rows.

use super::row_map::{stacked, Block, RowMap};
use super::row_map::{Map32, Split};
use super::rows::RowBlocks;
use crate::linalg::{inverse_sqrt, rank_floor, row_major, symmetric_eigen, Eigen, GramSum, Mat};
use anyhow::Result;
use faer::Par;

/// What every algorithm runs with: the threads of its decompositions, the matrix's name, and the
/// backend whose GEMM applies its map (a wide matrix's, made whole on the host).
pub(in crate::engine) struct MatrixWork<'a> {
    pub threads: usize,
    pub what: &'a str,
    pub backend: &'a dyn crate::backend::Backend,
}

/// A Gram matrix's eigendecomposition (values descending), with the floor of the numerical rank
/// (SPEC §4g) and the rank: how many values lie above it.
struct Spectrum {
    e: Eigen,
    floor: f64,
    rank: usize,
}

impl MatrixWork<'_> {
    /// The [`Spectrum`] of `gram`, the Gram matrix of a matrix of `shape`; `what` names it in an
    /// error, after the matrix's name.
    fn spectrum(&self, gram: Mat, shape: (usize, usize), what: &str) -> Result<Spectrum> {
        let e = symmetric_eigen(gram, self.threads, &format!("{}: {what}", self.what))?;
        let floor = rank_floor(e.values[0], shape);
        let rank = e.values.iter().take_while(|&&l| l > floor).count();
        Ok(Spectrum { e, floor, rank })
    }
}

/// The products of the host's GEMMs: on the caller's threads (faer's GEMM gives the same bits on
/// any number of them).
fn par() -> Par {
    Par::rayon(0)
}

/// `values` in f64, into `out`.
fn widen(values: &[f32], out: &mut Vec<f64>) {
    out.clear();
    out.extend(values.iter().map(|&x| f64::from(x)));
}

/// Iso-C (SPEC §4c): M = Σₜ τₜ (f64, agent order), G = MᵀM summed block by block, G = V Λ Vᵀ;
/// on the numerical rank, U Vᵀ = M·V Λ^{−1/2} Vᵀ and mean(S) = Σ √λ / n. The map:
/// W = α·mean(S)·V Λ^{−1/2} Vᵀ.
pub(in crate::engine) fn iso_c(
    rows: &mut dyn RowBlocks,
    alpha: f64,
    cx: &MatrixWork,
) -> Result<RowMap> {
    let (m, n) = rows.shape();
    let mut gram = GramSum::gram(n);
    let mut sum = Vec::new();
    rows.pass(&mut |b: &Block| {
        sum.clear();
        sum.resize(b.rows * n, 0.0f64);
        for tau in b.taus {
            sum.iter_mut()
                .zip(tau)
                .for_each(|(s, &t)| *s += f64::from(t));
        }
        let sum = row_major(&sum, n);
        gram.add(sum, sum, par());
        Ok(())
    })?;
    let sp = cx.spectrum(
        gram.into_sum(),
        (m, n),
        "the summed task vectors' Gram matrix",
    )?;
    let trace: f64 = sp.e.values[..sp.rank].iter().map(|l| l.sqrt()).sum();
    let scale = alpha * trace / n as f64;
    let w = inverse_sqrt(&sp.e, sp.floor);
    if w.kept == 0 {
        return Ok(RowMap::Zero);
    }
    Ok(RowMap::Summed(Split {
        large: Map32::of32(&(&w.large * faer::Scale(scale as f32))),
        right: &w.small * faer::Scale(scale),
        left: w.small,
    }))
}

/// TSV-M (SPEC §4d), T agents, k = ⌊n / T⌋: each agent's Gram matrix τₜᵀτₜ = Vₜ Λₜ Vₜᵀ gives its
/// top k right singular vectors and values sₜ = √λ (above the numerical rank); its left ones are
/// τₜ·Aₜ with Aₜ = Vₜ diag(1/sₜ). X_V = [V₁ … V_T], X_U = [τ₁A₁ … τ_T A_T]; their polar factors
/// P(X) = X (XᵀX)^{+1/2} (X_U's Gram matrix summed in a second pass over the rows). The map:
/// Δ = X_U · K with K = α · (X_UᵀX_U)^{+1/2} diag(s) P(X_V)ᵀ.
pub(in crate::engine) fn tsv(
    rows: &mut dyn RowBlocks,
    alpha: f64,
    cx: &MatrixWork,
) -> Result<RowMap> {
    let (m, n) = rows.shape();
    let agents = rows.agents();
    if n < agents {
        // k = 0: no agent keeps a direction (the authors' code gives zero too).
        return Ok(RowMap::Zero);
    }
    let k = n / agents;
    let mut grams: Vec<GramSum> = (0..agents).map(|_| GramSum::gram(n)).collect();
    let mut x = Vec::new();
    rows.pass(&mut |b: &Block| {
        for (gram, tau) in grams.iter_mut().zip(b.taus) {
            widen(tau, &mut x);
            let x = row_major(&x, n);
            gram.add(x, x, par());
        }
        Ok(())
    })?;
    let (mut a, mut vs, mut s) = (Vec::new(), Vec::new(), Vec::new());
    for (t, gram) in grams.into_iter().enumerate() {
        let what = format!("the Gram matrix of model {}'s task vector", t + 1);
        let sp = cx.spectrum(gram.into_sum(), (m, n), &what)?;
        let kept = sp.rank.min(k);
        let top = sp.e.vectors.as_ref().subcols(0, kept);
        let values: Vec<f64> = sp.e.values[..kept].iter().map(|l| l.sqrt()).collect();
        a.push(Mat::from_fn(n, kept, |i, c| top[(i, c)] / values[c]));
        vs.push(top.to_owned());
        s.extend(values);
    }
    let c = s.len();
    if c == 0 {
        return Ok(RowMap::Zero);
    }
    let xv = Mat::from_fn(n, c, |i, j| {
        let (t, col) = column_of(&vs, j);
        vs[t][(i, col)]
    });
    let pv = &xv * polar_right(&xv, (n, c), cx, "the agents' right singular vectors")?;
    let mut hu = GramSum::gram(c);
    rows.pass(&mut |b: &Block| {
        let xu = stacked(b, &a, n, par());
        hu.add(xu.as_ref(), xu.as_ref(), par());
        Ok(())
    })?;
    let su = cx.spectrum(hu.into_sum(), (m, c), "the agents' left singular vectors")?;
    let wu = inverse_sqrt(&su.e, su.floor);
    // Δ = X_U (L + F Fᵀ) D P_Vᵀ α: the large part's core in f32, the small part's in f64.
    let tail = Mat::from_fn(c, n, |j, col| s[j] * pv[(col, j)] * alpha);
    Ok(RowMap::Stacked {
        a,
        core: Split {
            large: Map32::of32(&(&wu.large * f32_of(tail.as_ref()))),
            right: (wu.small.transpose() * &tail).transpose().to_owned(),
            left: wu.small,
        },
    })
}

/// (XᵀX)^{+1/2} of `x` (`shape` its rows and columns), `what` naming it in an error.
fn polar_right(x: &Mat, shape: (usize, usize), cx: &MatrixWork, what: &str) -> Result<Mat> {
    let sp = cx.spectrum(x.transpose() * x, shape, what)?;
    Ok(inverse_sqrt(&sp.e, sp.floor).whole())
}

/// The agent and column within its block of column `j` of blocks `vs` side by side.
fn column_of(vs: &[Mat], mut j: usize) -> (usize, usize) {
    for (t, v) in vs.iter().enumerate() {
        if j < v.ncols() {
            return (t, j);
        }
        j -= v.ncols();
    }
    unreachable!("a column within the blocks")
}

/// SVC (SPEC §4e) of the method's merged update Δ_m, T agents: G = XᵀX = V Λ Vᵀ (σ = √λ) of the
/// rows X read, and Bₜ = XᵀXₜ, Xₜ agent t's τ read alike, summed block by block. Along direction
/// r (above the numerical rank) agent t's response is aₜ = u_rᵀτₜ, and sₜ = ⟨σ_r v_r, aₜ⟩/‖aₜ‖²
/// (α where the response is 0), γ_r = T / Σₜ max(α, sₜ). With X = Δ_m (rows ≥ columns), v_r is
/// V's column and aₜ = Bₜᵀv_r/σ_r: sₜ = λ_r ⟨v_r, Bₜᵀv_r⟩ / ‖Bₜᵀv_r‖². With X = Δ_mᵀ (a wide
/// matrix read transposed), V's column is u_r itself: sₜ = ⟨u_r, Bₜ u_r⟩ / ⟨u_r, Gₜ u_r⟩, Gₜ =
/// XₜᵀXₜ summed too. The map: W = V diag(γ) Vᵀ (γ = 1 on the directions below the threshold).
pub(in crate::engine) fn svc(
    rows: &mut dyn RowBlocks,
    alpha: f64,
    cx: &MatrixWork,
) -> Result<RowMap> {
    let (m, n) = rows.shape();
    let agents = rows.agents();
    let transposed = rows.transposed();
    let mut gram = GramSum::gram(n);
    let mut cross: Vec<GramSum> = (0..agents).map(|_| GramSum::cross(n)).collect();
    let mut own: Vec<GramSum> = match transposed {
        true => (0..agents).map(|_| GramSum::gram(n)).collect(),
        false => Vec::new(),
    };
    let (mut dm, mut x) = (Vec::new(), Vec::new());
    rows.pass(&mut |b: &Block| {
        let merged = b.merged.expect("SVC reads the merged update");
        widen(merged, &mut dm);
        let dm = row_major(&dm, n);
        gram.add(dm, dm, par());
        let merged32 = faer::MatRef::from_row_major_slice(merged, b.rows, n);
        for (t, (sum, tau)) in cross.iter_mut().zip(b.taus).enumerate() {
            let tau32 = faer::MatRef::from_row_major_slice(&tau[..], b.rows, n);
            sum.add_f32(merged32, tau32, par());
            if let Some(g) = own.get_mut(t) {
                widen(tau, &mut x);
                let xt = row_major(&x, n);
                g.add(xt, xt, par());
            }
        }
        Ok(())
    })?;
    let Spectrum { e, rank: kept, .. } =
        cx.spectrum(gram.into_sum(), (m, n), "the merged update's Gram matrix")?;
    let v = e.vectors.as_ref().subcols(0, kept);
    let mut sums = vec![0.0f64; kept];
    let mut own = own.into_iter();
    // Σ_j a[j, r]·b[j, r]: a column dot product.
    let dot = |a: faer::MatRef<f64>, b: faer::MatRef<f64>, r: usize| -> f64 {
        (0..n).map(|j| a[(j, r)] * b[(j, r)]).sum()
    };
    for sum in cross {
        // Per direction r: sₜ's numerator and denominator.
        let (num, den): (Vec<f64>, Vec<f64>) = match own.next() {
            None => {
                let y = widened(&(f32_of(sum.into_sum().transpose()) * f32_of(v)));
                let y = y.as_ref();
                (0..kept)
                    .map(|r| (e.values[r] * dot(v, y, r), dot(y, y, r)))
                    .unzip()
            }
            Some(g) => {
                let v32 = f32_of(v);
                let bu = widened(&(f32_of(sum.into_sum().as_ref()) * &v32));
                let gu = widened(&(f32_of(g.into_symmetric().as_ref()) * &v32));
                (0..kept)
                    .map(|r| (dot(v, bu.as_ref(), r), dot(v, gu.as_ref(), r)))
                    .unzip()
            }
        };
        for (r, total) in sums.iter_mut().enumerate() {
            *total += match den[r] > 0.0 {
                true => (num[r] / den[r]).max(alpha),
                false => alpha,
            };
        }
    }
    let gamma = |r: usize| match r < kept {
        true => agents as f64 / sums[r],
        false => 1.0,
    };
    let scaled = Mat::from_fn(n, n, |i, r| e.vectors[(i, r)] * gamma(r));
    // γ ∈ (0, T/α]: W's entries are bounded; it is made and applied in f32.
    Ok(RowMap::Merged {
        w: Map32::of32(&(f32_of(scaled.as_ref()) * f32_of(e.vectors.transpose()))),
    })
}

/// `m` rounded to f32: SVC's responses and map, whose sums need no more than f32's precision.
fn f32_of(m: faer::MatRef<f64>) -> faer::Mat<f32> {
    faer::Mat::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)] as f32)
}

/// `m` in f64.
fn widened(m: &faer::Mat<f32>) -> Mat {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| f64::from(m[(i, j)]))
}
