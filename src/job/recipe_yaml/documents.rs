//! A YAML file's documents, as a multi-stage recipe holds several (`crate::job::stages`).

/// The documents of a YAML text: each one's text and first line (from 1), split at the lines that
/// start a document (`---`, alone or before a comment or value); documents holding nothing but
/// comments and blank lines are left out.
pub(in crate::job) fn documents(text: &str) -> Vec<(String, usize)> {
    let mut docs = Vec::new();
    let (mut current, mut first) = (String::new(), 1);
    for (i, line) in text.lines().enumerate() {
        let marker = line.trim_end() == "---" || line.starts_with("--- ");
        if marker {
            docs.push((std::mem::take(&mut current), first));
            // What follows the marker on its line belongs to the document.
            current.push_str(line.get(4..).unwrap_or(""));
            current.push('\n');
            first = i + 1;
            continue;
        }
        current.push_str(line);
        current.push('\n');
    }
    docs.push((current, first));
    let has_content = |t: &str| {
        t.lines()
            .map(str::trim)
            .any(|l| !l.is_empty() && !l.starts_with('#') && l != "...")
    };
    docs.into_iter().filter(|(t, _)| has_content(t)).collect()
}

/// Whether a YAML document is a mergekit-moe config (it lists `experts`, and no `merge_method`):
/// `rlmerge moe`'s, no merge recipe nor a stage of one.
pub(in crate::job) fn is_moe_config(value: &serde_yaml::Value) -> bool {
    value.get("experts").is_some() && value.get("merge_method").is_none()
}
