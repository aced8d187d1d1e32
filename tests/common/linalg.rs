//! Small dense linear algebra in f64 for the spectral methods' references (tests/spectral.rs,
//! tests/svc.rs), written from the textbook, with no SVD library: products, Newton–Schulz polar
//! factors, cyclic Jacobi eigendecompositions.

/// a (m × k) · b (k × n), row-major, f64.
pub fn matmul(a: &[f64], b: &[f64], (m, k, n): (usize, usize, usize)) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = a[i * k + p];
            for j in 0..n {
                c[i * n + j] += x * b[p * n + j];
            }
        }
    }
    c
}

pub fn transpose(a: &[f64], (m, n): (usize, usize)) -> Vec<f64> {
    let mut t = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            t[j * m + i] = a[i * n + j];
        }
    }
    t
}

/// The orthogonal polar factor Q = U Vᵀ of a full-rank m × n matrix: Newton–Schulz,
/// X ← 1.5·X − 0.5·X Xᵀ X from X = M / ‖M‖_F (every singular value then lies in (0, 1]).
pub fn polar(mat: &[f64], (m, n): (usize, usize)) -> Vec<f64> {
    let norm = mat.iter().map(|x| x * x).sum::<f64>().sqrt();
    let mut x: Vec<f64> = mat.iter().map(|v| v / norm).collect();
    for _ in 0..200 {
        let xxt = matmul(&x, &transpose(&x, (m, n)), (m, n, m));
        let xxtx = matmul(&xxt, &x, (m, m, n));
        x = x
            .iter()
            .zip(&xxtx)
            .map(|(a, b)| 1.5 * a - 0.5 * b)
            .collect();
    }
    x
}

/// The eigenvalues and eigenvectors (columns of the returned n × n matrix, row-major) of a
/// symmetric n × n matrix, by cyclic Jacobi rotations until the off-diagonal vanishes.
pub fn jacobi_eigen(a: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut a = a.to_vec();
    let mut v: Vec<f64> = (0..n * n)
        .map(|k| if k / n == k % n { 1.0 } else { 0.0 })
        .collect();
    for _sweep in 0..100 {
        let off: f64 = (0..n * n)
            .filter(|k| k / n != k % n)
            .map(|k| a[k] * a[k])
            .sum();
        if off < 1e-30 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                if a[p * n + q].abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * a[p * n + q]);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let (c, s) = (1.0 / (t * t + 1.0).sqrt(), t / (t * t + 1.0).sqrt());
                // A ← Jᵀ A J on rows and columns p, q; V ← V J.
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..n).map(|i| a[i * n + i]).collect(), v)
}
