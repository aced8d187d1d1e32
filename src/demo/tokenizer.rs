//! The demo's tokenizer: a byte-level BPE (GPT-2's byte alphabet and Qwen2's pre-tokenizer) learned
//! from a few KB of English text when the demo is written, cut to the demo's vocabulary, so every
//! demo model folder loads in `tokenizers` / transformers and encodes text as a real one does.
//! Ids: `<unk>` 0, `<s>` 1, `</s>` 2 (the demo's generation_config), the 256 byte symbols
//! (printable ASCII first), then the merges in the order they were learned.

use serde_json::{json, Value};
use std::collections::HashMap;

/// Qwen2's pre-tokenizer pattern (its tokenizer.json's `Split`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The text the merges are learned from.
const CORPUS: &str = "\
Reinforcement learning changes few parameters of a language model, and different agents change \
different ones. A coding agent learns to write and test programs; a tool agent learns to call \
functions with the right arguments; a memory agent learns to keep what matters in a long context. \
When the agents are merged into one model, the parameters that only one agent changed carry that \
agent's skill, and averaging them with the unchanged values of the other agents would wash the \
skill out. Reinforced agent merging keeps every unique change whole, averages a shared change over \
the agents that made it, and keeps the base value where no agent changed anything. \
The merged model should answer questions, write code, call tools and remember the conversation. \
It reads the prompt, thinks about the task, and then writes the answer one token after another. \
A tokenizer turns the text into tokens: short pieces of words that the model has seen many times. \
Common words such as the, and, of, to, in, is, that, for, it, with, as, on, be, at, by, this, \
have, from, or, one, had, not, but, what, all, were, when, we, there, can, an, your, which, their \
and said become single tokens, while rare words are split into smaller pieces. Numbers like 1, 2, \
3, 10, 42, 100, 2024 and 65536 are split digit by digit or in small groups. Punctuation, quotes \
(\"like these\") and brackets [like these] or {these} are tokens of their own. \
def merge(base, agents): return base + sum(agent - base for agent in agents) / len(agents) \
print(\"hello world\") # a comment; x = 3.14 * radius ** 2; if x > 0: return True else: False \
The quick brown fox jumps over the lazy dog. Hello world! How are you today? I am fine, thanks. \
Models are trained, evaluated, merged, tested and released. Training data, evaluation tasks and \
benchmarks measure how well the merged model keeps the skills of each agent it was built from.";

/// Special tokens, at ids 0, 1, 2.
const SPECIALS: [&str; 3] = ["<unk>", "<s>", "</s>"];

/// GPT-2's byte-level alphabet: byte `b`'s printable stand-in.
fn byte_symbol(b: u8) -> char {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    if printable(b) {
        return b as char;
    }
    // The others take the code points from 256 on, in byte order.
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("a valid code point")
}

/// The demo's tokenizer.json for a vocabulary of `vocab` rows: at most `vocab` tokens.
pub fn tokenizer_json(vocab: usize) -> Value {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    // Printable ASCII first, so the smallest vocabularies still spell plain text.
    let bytes = (32u8..=126).chain((0u8..32).chain(127..=255));
    tokens.extend(bytes.map(|b| byte_symbol(b).to_string()));
    tokens.truncate(vocab);
    let mut ids: HashMap<String, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = learn_merges(&mut tokens, &mut ids, vocab);
    let vocab_map: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = SPECIALS
        .iter()
        .enumerate()
        .take(vocab)
        .map(|(i, s)| {
            json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    // Qwen2's own pre-tokenizer (its tokenizer.json's, which transformers 5's Qwen2Tokenizer
    // rebuilds whatever the file says): its split pattern — digits one by one — then the bytes.
    let qwen2_split = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": qwen2_split,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": "<unk>",
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "vocab": vocab_map,
            "merges": merges,
        }
    })
}

/// Learns merges from [`CORPUS`] until `tokens` holds `vocab` or no pair repeats: each step
/// merges the most frequent adjacent pair within a word (ties: the pair of smaller ids), as BPE
/// training does. Words are the corpus split before each space and around punctuation, roughly
/// as the byte-level pre-tokenizer splits text. Returns the merges as "A B".
fn learn_merges(
    tokens: &mut Vec<String>,
    ids: &mut HashMap<String, u32>,
    vocab: usize,
) -> Vec<String> {
    let mut words: HashMap<Vec<u32>, usize> = HashMap::new();
    for word in pre_split(CORPUS) {
        let symbols: Option<Vec<u32>> = word
            .bytes()
            .map(|b| ids.get(&byte_symbol(b).to_string()).copied())
            .collect();
        if let Some(symbols) = symbols {
            *words.entry(symbols).or_default() += 1;
        }
    }
    let mut words: Vec<(Vec<u32>, usize)> = words.into_iter().collect();
    words.sort();
    let mut merges = Vec::new();
    while tokens.len() < vocab {
        let mut pairs: HashMap<(u32, u32), usize> = HashMap::new();
        for (w, n) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0], p[1])).or_default() += n;
            }
        }
        let Some((&(a, b), &count)) = pairs
            .iter()
            .max_by(|x, y| x.1.cmp(y.1).then_with(|| y.0.cmp(x.0)))
        else {
            break;
        };
        if count < 2 {
            break;
        }
        let merged = format!("{}{}", tokens[a as usize], tokens[b as usize]);
        let id = tokens.len() as u32;
        merges.push(format!("{} {}", tokens[a as usize], tokens[b as usize]));
        ids.insert(merged.clone(), id);
        tokens.push(merged);
        for (w, _) in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if (w[i], w[i + 1]) == (a, b) {
                    w[i] = id;
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
    }
    merges
}

/// `text` split as the byte-level pre-tokenizer roughly splits it: a word with the space before
/// it, a run of digits, a run of punctuation.
fn pre_split(text: &str) -> Vec<&str> {
    let class = |c: char| {
        if c.is_alphabetic() {
            0
        } else if c.is_numeric() {
            1
        } else if c.is_whitespace() {
            2
        } else {
            3
        }
    };
    let mut words = Vec::new();
    let mut start = 0;
    let mut prev: Option<u8> = None;
    for (i, c) in text.char_indices() {
        let k = class(c);
        // A space starts a word and joins the word after it.
        let boundary = match prev {
            None => false,
            Some(2) => k == 2,
            Some(p) => k != p,
        };
        if boundary {
            words.push(&text[start..i]);
            start = i;
        }
        prev = Some(k);
    }
    words.push(&text[start..]);
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids run 0..n without a gap within the vocabulary, every merge joins two tokens into a third
    /// of the vocabulary, and the byte alphabet is GPT-2's (space is 'Ġ', newline 'Ċ').
    #[test]
    fn the_tokenizer_is_well_formed_at_every_size() {
        assert_eq!(byte_symbol(b' '), 'Ġ');
        assert_eq!(byte_symbol(b'\n'), 'Ċ');
        assert_eq!(byte_symbol(b'a'), 'a');
        for vocab in [64, 512, 32000] {
            let t = tokenizer_json(vocab);
            let map = t["model"]["vocab"].as_object().unwrap();
            assert!(map.len() <= vocab);
            let mut ids: Vec<u64> = map.values().map(|v| v.as_u64().unwrap()).collect();
            ids.sort();
            assert_eq!(ids, (0..map.len() as u64).collect::<Vec<_>>());
            for m in t["model"]["merges"].as_array().unwrap() {
                let (a, b) = m.as_str().unwrap().split_once(' ').unwrap();
                assert!(map.contains_key(a) && map.contains_key(b), "{m}");
                assert!(map.contains_key(&format!("{a}{b}")), "{m}");
            }
            if vocab >= 512 {
                assert!(map.contains_key("Ġthe"), "common words are single tokens");
                assert!(t["model"]["merges"].as_array().unwrap().len() > 200);
            }
        }
    }
}
