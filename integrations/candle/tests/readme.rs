//! The candle block of ferrogloo's README cannot be a doctest there (candle is not a dependency
//! of `ferrogloo`); it must be the text of this crate's README, whose blocks are doctests.

/// The first code block after `heading` that starts with "```" + `fence`, without rustdoc's
/// hidden lines (`# ...`).
fn block(text: &str, heading: &str, fence: &str) -> String {
    let from = text.find(heading).unwrap_or_else(|| panic!("no {heading:?}"));
    let rest = &text[from..];
    let open = rest.find(&format!("```{fence}\n")).unwrap_or_else(|| panic!("no ```{fence} block after {heading:?}"));
    let body = &rest[open + fence.len() + 4..];
    let body = &body[..body.find("```").expect("a closed block")];
    body.lines().filter(|l| !l.starts_with("# ")).collect::<Vec<_>>().join("\n")
}

#[test]
fn the_main_readmes_candle_block_is_this_crates_doctested_one() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let main = std::fs::read_to_string(format!("{dir}/../../README.md")).expect("ferrogloo's README");
    let ours = std::fs::read_to_string(format!("{dir}/README.md")).expect("this crate's README");
    let theirs = block(&main, "## Using it from candle", "rust,ignore");
    let tested = block(&ours, "The lines a training loop adds", "rust,no_run");
    assert!(theirs.lines().count() > 8, "{theirs}");
    assert!(tested.contains(&theirs), "ferrogloo's README shows:\n{theirs}\n\nwhich is not in the doctest:\n{tested}");
}
