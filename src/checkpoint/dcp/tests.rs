use super::*;

fn chunk(offsets: &[usize], sizes: &[usize]) -> Chunk {
    Chunk {
        offsets: offsets.to_vec(),
        sizes: sizes.to_vec(),
    }
}

fn order(size: &[usize], chunks: &[Chunk]) -> Result<Vec<usize>> {
    Ok(row_order(size, chunks)?
        .into_iter()
        .map(|c| c.offsets[0])
        .collect())
}

#[test]
fn row_chunks_are_read_in_row_order_whatever_the_metadata_order() {
    let chunks = [
        chunk(&[3, 0], &[2, 4]),
        chunk(&[0, 0], &[3, 4]),
        chunk(&[5, 0], &[0, 4]),
    ];
    assert_eq!(order(&[5, 4], &chunks).unwrap(), vec![0, 3]);
    assert_eq!(order(&[7], &[chunk(&[0], &[7])]).unwrap(), vec![0]);
}

#[test]
fn overlapping_missing_and_column_chunks_are_refused() {
    let cases: [(&[usize], Vec<Chunk>, &str); 5] = [
        (
            &[5, 4],
            vec![chunk(&[0, 0], &[3, 4]), chunk(&[2, 0], &[3, 4])],
            "overlap at",
        ),
        (
            &[5, 4],
            vec![chunk(&[0, 0], &[2, 4]), chunk(&[3, 0], &[2, 4])],
            "leave out",
        ),
        (&[5, 4], vec![chunk(&[0, 0], &[3, 4])], "3 of its 5 rows"),
        (
            &[4, 4],
            vec![chunk(&[0, 0], &[4, 2]), chunk(&[0, 2], &[4, 2])],
            "dimension 1",
        ),
        (&[4, 4], vec![chunk(&[0], &[4])], "in a tensor of"),
    ];
    for (size, chunks, words) in cases {
        let err = format!("{:#}", order(size, &chunks).unwrap_err());
        assert!(err.contains(words), "{err}");
    }
}

#[test]
fn only_plain_distcp_names_in_the_folder_are_opened() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for bad in [
        "../x.distcp",
        "a/b.distcp",
        ".hidden.distcp",
        "model.safetensors",
    ] {
        let err = format!("{:#}", file_index(dir.path(), &mut files, bad).unwrap_err());
        assert!(err.contains("no .distcp file of the folder"), "{err}");
    }
}
