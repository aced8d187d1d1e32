//! The one rule for showing a name read from a file or given by a user (a tensor name from a
//! safetensors header, a folder name, a recipe key) in each medium rlmerge writes: a terminal
//! line, Markdown (the model card), XML (the SVG figures). A name is data: whatever it holds, it
//! must not forge lines, drive the terminal, reorder text (bidi controls), open a heading, link or
//! image, leave its code span, or make a file invalid.

use std::borrow::Cow;

/// Characters shown escaped in every medium: control characters (C0, DEL, C1) and the invisible
/// formatting characters that reorder or hide text (bidi embeddings, overrides, isolates and
/// marks, zero-width joiners and spaces, the byte-order mark).
pub fn is_hidden(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{2069}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}'
        )
}

/// Characters XML 1.0 does not allow in a document at all (not even as references).
fn xml_forbids(c: char) -> bool {
    let u = c as u32;
    (u < 0x20 && !matches!(c, '\t' | '\n' | '\r')) || u == 0xfffe || u == 0xffff
}

/// `text` for a terminal line or a one-line message: hidden characters written as Rust-style
/// escapes (`\n`, `\u{1b}`, `\u{202e}`), the rest kept.
pub fn terminal(text: &str) -> Cow<'_, str> {
    if !text.chars().any(|c| is_hidden(c) || xml_forbids(c)) {
        return text.into();
    }
    let mut s = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if is_hidden(c) || xml_forbids(c) {
            s.extend(c.escape_default());
        } else {
            s.push(c);
        }
    }
    s.into()
}

/// `text` as XML character data or an attribute value: [`terminal`]'s escapes (which also remove
/// every character XML forbids), then `&`, `<`, `>`, `"` and `'` as entities.
pub fn xml(text: &str) -> String {
    let mut s = String::with_capacity(text.len() + 8);
    for c in terminal(text).chars() {
        match c {
            '&' => s.push_str("&amp;"),
            '<' => s.push_str("&lt;"),
            '>' => s.push_str("&gt;"),
            '"' => s.push_str("&quot;"),
            '\'' => s.push_str("&apos;"),
            c => s.push(c),
        }
    }
    s
}

/// `text` as a Markdown code span: backticks enough that none inside closes it, padded where the
/// text starts or ends with a backtick, on one line ([`terminal`]'s escapes). Renders as the
/// literal text: no heading, link, image or HTML inside a code span is interpreted.
pub fn markdown_code(text: &str) -> String {
    let text = terminal(text);
    let longest = text.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    let fence = "`".repeat(longest + 1);
    let pad = if text.starts_with('`') || text.ends_with('`') || text.is_empty() {
        " "
    } else {
        ""
    };
    format!("{fence}{pad}{text}{pad}{fence}")
}

/// `text` as a fenced Markdown code block of language `lang`: a fence longer than any run of
/// backticks in it (no line of it can close the block), each line with [`terminal`]'s escapes
/// (hidden characters made visible).
pub fn markdown_block(lang: &str, text: &str) -> String {
    let longest = text.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    let fence = "`".repeat(longest.max(2) + 1);
    let mut block = format!("{fence}{lang}\n");
    for line in text.lines() {
        block.push_str(&terminal(line));
        block.push('\n');
    }
    block + &fence + "\n"
}

/// `text` as inline Markdown text (a table cell, a list item): [`terminal`]'s escapes, every ASCII
/// punctuation character Markdown could read as syntax backslash-escaped, and `<`, `>`, `&` as
/// entities so no HTML is read.
pub fn markdown_text(text: &str) -> String {
    let mut s = String::with_capacity(text.len() + 8);
    for c in terminal(text).chars() {
        match c {
            '<' => s.push_str("&lt;"),
            '>' => s.push_str("&gt;"),
            '&' => s.push_str("&amp;"),
            '\\' | '`' | '*' | '_' | '{' | '}' | '[' | ']' | '(' | ')' | '#' | '+' | '-' | '.'
            | '!' | '|' | '~' | '"' | '=' | ':' => {
                s.push('\\');
                s.push(c);
            }
            c => s.push(c),
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(terminal("model.λ.weight"), "model.λ.weight");
        assert_eq!(
            terminal("a\nmerged 3 model(s)\u{1b}]0;title\u{7}"),
            "a\\nmerged 3 model(s)\\u{1b}]0;title\\u{7}"
        );
        assert_eq!(terminal("abc\u{202e}fdp.exe"), "abc\\u{202e}fdp.exe");
        assert_eq!(terminal("x\u{ffff}"), "x\\u{ffff}");
    }

    #[test]
    fn xml_text_is_valid_and_literal() {
        assert_eq!(
            xml("<a href=\"x\">&'\u{ffff}\u{1}"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&apos;\\u{ffff}\\u{1}"
        );
        assert!(!xml("\u{fffe}\u{0}").chars().any(xml_forbids));
    }

    #[test]
    fn markdown_code_spans_cannot_be_left() {
        assert_eq!(markdown_code("plain"), "`plain`");
        assert_eq!(markdown_code("a`b"), "``a`b``");
        assert_eq!(markdown_code("`x``"), "``` `x`` ```");
        // A block's fence outlasts any backtick run inside: a line of ``` cannot close it.
        assert_eq!(
            markdown_block("yaml", "a: 1\n```\n# b"),
            "````yaml\na: 1\n```\n# b\n````\n"
        );
        assert_eq!(markdown_code("a\n# b"), "`a\\n# b`");
        assert_eq!(markdown_code(""), "`  `");
    }

    #[test]
    fn markdown_text_reads_as_text() {
        assert_eq!(
            markdown_text("# h ![i](x) <img>"),
            "\\# h \\!\\[i\\]\\(x\\) &lt;img&gt;"
        );
        assert_eq!(markdown_text("a|b\nc"), "a\\|b\\\\nc");
    }
}
