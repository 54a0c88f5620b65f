//! The built-in synthetic corpus (docs/architecture.md §7): English-like text from a
//! small grammar, generated from a fixed seed, so a first run needs no download.

use crate::rng::Rng;
use ir::spec::SyntheticCorpus;

/// Size of the built-in synthetic corpus in bytes (approximately; it ends at a paragraph).
pub const SYNTHETIC_BYTES: usize = 300_000;

/// The built-in corpus: English-like paragraphs from a small grammar with
/// subject–verb agreement, fixed word lists, punctuation and quoted speech,
/// generated from a fixed seed. It needs no download and has structure at the
/// byte level (spelling, agreement, sentence shape) that a small model learns
/// well below the unigram entropy.
pub fn synthetic_corpus(kind: SyntheticCorpus) -> Vec<u8> {
    match kind {
        SyntheticCorpus::Default => Grammar::new(0x5EED_0F7E_2700).text(SYNTHETIC_BYTES).into_bytes(),
    }
}

const NAMES: &[&str] =
    &["Alice", "Bruno", "Clara", "David", "Emma", "Felix", "Grace", "Henry", "Iris", "Jonas"];
const DETS: &[&str] = &["the", "a", "every", "this", "that", "my", "our", "one"];
const PLURAL_DETS: &[&str] = &["the", "some", "these", "those", "my", "our", "many", "two"];
const ADJS: &[&str] = &[
    "small", "quiet", "old", "bright", "green", "heavy", "clever", "gentle", "happy", "red", "cold", "tall",
];
const NOUNS: &[(&str, &str)] = &[
    ("cat", "cats"),
    ("dog", "dogs"),
    ("river", "rivers"),
    ("garden", "gardens"),
    ("window", "windows"),
    ("teacher", "teachers"),
    ("farmer", "farmers"),
    ("child", "children"),
    ("stone", "stones"),
    ("house", "houses"),
    ("bird", "birds"),
    ("book", "books"),
    ("tree", "trees"),
    ("letter", "letters"),
    ("ship", "ships"),
    ("mouse", "mice"),
];
/// (base, third person singular, past)
const TRANSITIVE: &[(&str, &str, &str)] = &[
    ("see", "sees", "saw"),
    ("find", "finds", "found"),
    ("carry", "carries", "carried"),
    ("watch", "watches", "watched"),
    ("follow", "follows", "followed"),
    ("paint", "paints", "painted"),
    ("build", "builds", "built"),
    ("open", "opens", "opened"),
    ("like", "likes", "liked"),
    ("help", "helps", "helped"),
];
const INTRANSITIVE: &[(&str, &str, &str)] = &[
    ("sleep", "sleeps", "slept"),
    ("run", "runs", "ran"),
    ("wait", "waits", "waited"),
    ("sing", "sings", "sang"),
    ("rest", "rests", "rested"),
    ("fall", "falls", "fell"),
    ("shine", "shines", "shone"),
    ("turn", "turns", "turned"),
];
const ADVERBS: &[&str] = &["slowly", "quickly", "often", "never", "always", "quietly", "again"];
const PREPS: &[&str] = &["near", "under", "behind", "over", "beside", "into", "across"];
const CONJS: &[&str] = &["and", "but", "because", "while", "so"];
const SPEECH: &[&str] = &["said", "asked", "whispered", "answered"];

struct Grammar {
    rng: Rng,
}

impl Grammar {
    fn new(seed: u64) -> Self {
        Grammar { rng: Rng::from_seed(seed) }
    }

    fn pick<'a>(&mut self, words: &[&'a str]) -> &'a str {
        words[self.rng.below(words.len() as u64) as usize]
    }

    fn chance(&mut self, p: f64) -> bool {
        self.rng.next_f64() < p
    }

    /// A noun phrase and whether it is plural.
    fn noun_phrase(&mut self) -> (String, bool) {
        if self.chance(0.2) {
            return (self.pick(NAMES).to_string(), false);
        }
        let plural = self.chance(0.35);
        let (sg, pl) = NOUNS[self.rng.below(NOUNS.len() as u64) as usize];
        let det = if plural { self.pick(PLURAL_DETS) } else { self.pick(DETS) };
        let adj = if self.chance(0.45) { format!("{} ", self.pick(ADJS)) } else { String::new() };
        // "a" before a vowel sound becomes "an".
        let det = if det == "a" && adj.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { det };
        (format!("{det} {adj}{}", if plural { pl } else { sg }), plural)
    }

    fn clause(&mut self, past: bool) -> String {
        let (subject, plural) = self.noun_phrase();
        let mut s = subject;
        if self.chance(0.2) {
            s.push(' ');
            s.push_str(self.pick(ADVERBS));
        }
        let transitive = self.chance(0.6);
        let table = if transitive { TRANSITIVE } else { INTRANSITIVE };
        let (base, third, past_form) = table[self.rng.below(table.len() as u64) as usize];
        let verb = if past {
            past_form
        } else if plural {
            base
        } else {
            third
        };
        s.push(' ');
        s.push_str(verb);
        if transitive {
            s.push(' ');
            s.push_str(&self.noun_phrase().0);
        }
        if self.chance(0.35) {
            s.push(' ');
            s.push_str(self.pick(PREPS));
            s.push(' ');
            s.push_str(&self.noun_phrase().0);
        }
        s
    }

    fn sentence(&mut self, past: bool) -> String {
        let roll = self.rng.next_f64();
        let body = if roll < 0.15 {
            let (subject, plural) = self.noun_phrase();
            let aux = if past {
                "did"
            } else if plural {
                "do"
            } else {
                "does"
            };
            let (base, _, _) = TRANSITIVE[self.rng.below(TRANSITIVE.len() as u64) as usize];
            return capitalize(&format!("{aux} {subject} {base} {}?", self.noun_phrase().0));
        } else if roll < 0.3 {
            let inner = capitalize(&self.clause(past));
            let speaker = self.pick(NAMES);
            let verb = self.pick(SPEECH);
            return format!("\"{inner},\" {verb} {speaker}.");
        } else if roll < 0.55 {
            let first = self.clause(past);
            let conj = self.pick(CONJS);
            format!("{first}, {conj} {}", self.clause(past))
        } else {
            self.clause(past)
        };
        capitalize(&format!("{body}."))
    }

    fn text(&mut self, bytes: usize) -> String {
        let mut out = String::with_capacity(bytes + 1024);
        while out.len() < bytes {
            let past = self.chance(0.5);
            let sentences = 3 + self.rng.below(5);
            for i in 0..sentences {
                if i > 0 {
                    out.push(' ');
                }
                out.push_str(&self.sentence(past));
            }
            out.push_str("\n\n");
        }
        out
    }
}

fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}
