//! Symmetric eigendecomposition, the one decomposition the spectral methods run on the host:
//! faer's (Householder tridiagonalization, divide and conquer), in f64, largest eigenvalue first.
//!
//! Two properties the engine needs of it, which faer does not give by default:
//! - **The same bits for any thread count.** faer splits the tridiagonalization's symmetric
//!   matrix-vector products into one partial sum per thread, so its rounding follows the thread
//!   count. Here the work is always cut into [`SPLIT`] parts, whatever number of threads run
//!   them (`threads`, a pool of its own): `--threads 1` and `--threads 16` give the same bits.
//! - **An answer to Ctrl-C within a poll.** A 4096 × 4096 decomposition takes seconds and cannot
//!   be stopped midway; it runs on a thread of its own while the caller polls its job's
//!   cancellation token ([`crate::cancel`]) and, once a stop is requested, returns
//!   [`crate::cancel::Interrupted`] at once, leaving the decomposition to finish unseen.

use super::Mat;
use anyhow::{anyhow, Result};
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::evd::{self_adjoint_evd, self_adjoint_evd_scratch, ComputeEigenvectors};
use faer::Par;
use std::time::Duration;

/// Parts the tridiagonalization's products are cut into, whatever thread count runs them.
const SPLIT: usize = 8;

/// How often a caller waiting for a decomposition looks at its cancellation token.
const POLL: Duration = Duration::from_millis(20);

/// A symmetric matrix A = V diag(λ) Vᵀ: eigenvalues largest first, eigenvectors as V's columns
/// in the same order.
pub struct Eigen {
    pub values: Vec<f64>,
    pub vectors: Mat,
}

/// The eigendecomposition of symmetric `a` (its lower triangle is read) in f64, on `threads`
/// threads (0: every core); `what` names the matrix in an error. Returns
/// [`crate::cancel::Interrupted`] soon after the calling job is asked to stop.
pub fn symmetric_eigen(a: Mat, threads: usize, what: &str) -> Result<Eigen> {
    cancellable(threads, what, move |what| decompose(&a, what))
}

/// Runs `work` (a decomposition) on a thread of its own in a pool of `threads`, answering the
/// calling job's cancellation while it runs.
fn cancellable(
    threads: usize,
    what: &str,
    work: impl FnOnce(&str) -> Result<Eigen> + Send + 'static,
) -> Result<Eigen> {
    let token = crate::cancel::current();
    token.check()?;
    let (send, receive) = std::sync::mpsc::channel();
    let what_owned = what.to_string();
    std::thread::Builder::new()
        .name("rlmerge-eigen".into())
        .spawn(move || {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
            let result = match pool {
                Ok(pool) => pool.install(|| work(&what_owned)),
                Err(e) => Err(anyhow!(
                    "cannot start the threads of an eigendecomposition: {e}"
                )),
            };
            // The caller may have stopped waiting: then nobody reads it.
            let _ = send.send(result);
        })
        .map_err(|e| anyhow!("cannot start an eigendecomposition's thread: {e}"))?;
    loop {
        match receive.recv_timeout(POLL) {
            Ok(result) => return result,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => token.check()?,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(anyhow!(
                    "the eigendecomposition of {what} stopped (a panic)"
                ))
            }
        }
    }
}

/// faer's decomposition of `a`, its work cut into [`SPLIT`] parts, sorted largest first. (In
/// f64: faer's f32 decomposition of a 4096 × 4096 Gram matrix leaves its eigenvectors a few 10⁻⁶
/// off, which an inverse square root turns into errors of 10⁻³ on a 7B attention matrix's
/// polar factor; measured.)
fn decompose(a: &Mat, what: &str) -> Result<Eigen> {
    let n = a.nrows();
    let par = Par::rayon(SPLIT);
    let mut s = faer::diag::Diag::<f64>::zeros(n);
    let mut u = Mat::zeros(n, n);
    let scratch =
        self_adjoint_evd_scratch::<f64>(n, ComputeEigenvectors::Yes, par, Default::default());
    self_adjoint_evd(
        a.as_ref(),
        s.as_mut(),
        Some(u.as_mut()),
        par,
        MemStack::new(&mut MemBuffer::new(scratch)),
        Default::default(),
    )
    .map_err(|e| anyhow!("the eigendecomposition of {what} did not converge ({e:?})"))?;
    let s = s.column_vector();
    // faer gives them in nondecreasing order.
    let order: Vec<usize> = (0..n).rev().collect();
    Ok(Eigen {
        values: order.iter().map(|&i| s[i]).collect(),
        vectors: Mat::from_fn(n, n, |r, c| u[(r, order[c])]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A symmetric matrix of known spectrum: Q diag(λ) Qᵀ with Q a product of reflections.
    fn planted(values: &[f64]) -> Mat {
        let n = values.len();
        let h = Mat::from_fn(n, 1, |i, _| ((i * 7 + 3) % 11) as f64 - 5.0);
        let norm2: f64 = (0..n).map(|i| h[(i, 0)] * h[(i, 0)]).sum();
        let q = Mat::from_fn(n, n, |i, j| {
            f64::from(u8::from(i == j)) - 2.0 * h[(i, 0)] * h[(j, 0)] / norm2
        });
        let d = Mat::from_fn(n, n, |i, j| if i == j { values[i] } else { 0.0 });
        &q * &d * q.transpose()
    }

    #[test]
    fn eigenvalues_come_largest_first_with_their_vectors() {
        let a = planted(&[1.0, 5.0, -2.0, 3.0]);
        let e = symmetric_eigen(a.clone(), 1, "a").unwrap();
        let want = [5.0, 3.0, 1.0, -2.0];
        for (got, want) in e.values.iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{:?}", e.values);
        }
        for c in 0..4 {
            let v = e.vectors.col(c);
            let av = &a * v;
            for r in 0..4 {
                assert!((av[r] - e.values[c] * v[r]).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn the_bits_do_not_depend_on_the_thread_count() {
        let n = 300;
        let a = Mat::from_fn(n, n, |i, j| {
            let (i, j) = (i.max(j), i.min(j));
            ((i * 7919 + j * 104_729) % 1000) as f64 / 1000.0 - 0.5
        });
        let bits = |threads| {
            let e = symmetric_eigen(a.clone(), threads, "a").unwrap();
            let mut all: Vec<u64> = e.values.iter().map(|x| x.to_bits()).collect();
            for c in 0..n {
                all.extend(e.vectors.col(c).iter().map(|x| x.to_bits()));
            }
            all
        };
        let one = bits(1);
        assert_eq!(one, bits(2));
        assert_eq!(one, bits(3));
    }

    #[test]
    fn a_stop_request_is_answered_without_waiting_for_the_decomposition() {
        let token = crate::cancel::Token::new();
        crate::cancel::set_current(token.clone());
        token.request();
        let err = symmetric_eigen(Mat::zeros(3, 3), 1, "a").err().unwrap();
        assert!(crate::cancel::is_interrupted(&err));
        crate::cancel::set_current(crate::cancel::Token::new());
    }
}
