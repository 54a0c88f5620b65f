//! Data loading, splitting, sampling and the synthetic corpus.

use ir::spec::{DataSpec, SyntheticCorpus};
use runtime::data::{synthetic_corpus, BatchSampler, Corpus, DataError, SYNTHETIC_BYTES};

fn entropy_bits(counts: &std::collections::HashMap<Vec<u8>, usize>) -> f64 {
    let n: usize = counts.values().sum();
    counts.values().map(|&c| c as f64 / n as f64).map(|p| -p * p.log2()).sum()
}

#[test]
fn synthetic_corpus_is_deterministic_and_structured() {
    let a = synthetic_corpus(SyntheticCorpus::Default);
    let b = synthetic_corpus(SyntheticCorpus::Default);
    assert_eq!(a, b);
    assert!(a.len() >= SYNTHETIC_BYTES && a.len() < SYNTHETIC_BYTES + 4096, "{} bytes", a.len());
    assert!(a.iter().all(|&c| c.is_ascii()), "plain ASCII text");
    let mut uni = std::collections::HashMap::new();
    let mut bi = std::collections::HashMap::new();
    for w in a.windows(2) {
        *uni.entry(vec![w[0]]).or_insert(0) += 1;
        *bi.entry(w.to_vec()).or_insert(0) += 1;
    }
    let h1 = entropy_bits(&uni);
    // Conditional entropy H(X_t | X_{t-1}) = H(X_{t-1}, X_t) − H(X_{t-1}).
    let h_cond = entropy_bits(&bi) - h1;
    assert!(h1 > 3.5, "unigram entropy {h1}: the text should use many letters");
    assert!(h_cond < h1 - 1.0, "bigram conditional entropy {h_cond} vs unigram {h1}");
}

#[test]
fn split_keeps_the_last_fraction_for_validation() {
    let bytes: Vec<u8> = (0..100u8).collect();
    let c = Corpus::from_bytes("mem".into(), bytes.clone(), 0.1, 8).unwrap();
    assert_eq!(c.train().bytes().unwrap(), &bytes[..90]);
    assert_eq!(c.validation().bytes().unwrap(), &bytes[90..]);
}

#[test]
fn sampling_is_deterministic_per_seed_and_reads_whole_windows() {
    let bytes: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
    let corpus = Corpus::from_bytes("mem".into(), bytes, 0.5, 17).unwrap();
    let text = corpus.train();
    let mut a = BatchSampler::train(3, 4, 17);
    let mut b = BatchSampler::train(3, 4, 17);
    let mut c = BatchSampler::train(4, 4, 17);
    let (ba, bb, bc) =
        (a.next_batch(text).unwrap(), b.next_batch(text).unwrap(), c.next_batch(text).unwrap());
    assert_eq!(ba.len(), 4 * 17);
    assert_eq!(ba, bb);
    assert_ne!(ba, bc);
    // Each window is consecutive bytes of the text (here: consecutive values mod 256).
    for w in ba.chunks(17) {
        for pair in w.windows(2) {
            assert_eq!((pair[0] + 1) % 256, pair[1]);
        }
    }
    // Restoring the state continues the same sequence.
    let mut resumed = BatchSampler::from_state(a.state(), 4, 17);
    assert_eq!(a.next_batch(text).unwrap(), resumed.next_batch(text).unwrap());
    // Validation uses its own stream.
    assert_ne!(BatchSampler::validation(3, 4, 17).next_batch(text).unwrap(), ba);
}

#[test]
fn missing_file_names_the_path() {
    let path = "/nonexistent/widen-data/corpus.txt";
    let err = Corpus::load_data(&DataSpec::Text(path.into()), 0.1, 17, 256).unwrap_err();
    assert!(matches!(err, DataError::Read { .. }));
    assert!(err.to_string().contains(path), "{err}");
}

#[test]
fn short_text_names_the_file_and_the_needed_length() {
    let dir = std::env::temp_dir().join(format!("widen-data-short-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.txt");
    std::fs::write(&path, b"hello world, this is short").unwrap();
    let spec = DataSpec::Text(path.display().to_string());
    let err = Corpus::load_data(&spec, 0.1, 17, 256).unwrap_err();
    let DataError::TooShort { needed, len, .. } = &err else { panic!("{err}") };
    assert_eq!(*len, 26);
    // 17-token windows with 10% validation need 170 bytes.
    assert_eq!(*needed, 170);
    let msg = err.to_string();
    assert!(msg.contains("tiny.txt") && msg.contains("170"), "{msg}");
    // Exactly the needed length is enough.
    let ok = Corpus::from_bytes("x".into(), vec![b'a'; *needed], 0.1, 17).unwrap();
    assert!(ok.validation().len() >= 17 && ok.train().len() >= 17);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `Corpus::load` of `path` on another thread, failing the test if it has not
/// returned within a minute (a read of a FIFO would block for ever).
fn load_within_a_minute(path: &std::path::Path) -> Result<Corpus, DataError> {
    let spec = DataSpec::Text(path.display().to_string());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(Corpus::load_data(&spec, 0.1, 8, 256));
    });
    rx.recv_timeout(std::time::Duration::from_secs(60)).expect("Corpus::load returned within a minute")
}

#[test]
fn only_regular_files_are_read_as_text() {
    let dir = std::env::temp_dir().join(format!("widen-data-kinds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("pipe");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let cases = [
        (fifo.clone(), "a FIFO (named pipe)"),
        (std::path::PathBuf::from("/dev/null"), "a character device"),
        (dir.clone(), "a folder"),
    ];
    for (path, kind) in cases {
        let err = load_within_a_minute(&path).unwrap_err();
        assert!(matches!(&err, DataError::NotAFile { kind: k, .. } if *k == kind), "{err}");
        assert_eq!(
            err.to_string(),
            format!("training text {} is {kind}, not a regular file; give a file of bytes", path.display())
        );
    }
    // A symlink to a regular file reads the file.
    let text: Vec<u8> = (0..200u8).collect();
    std::fs::write(dir.join("text"), &text).unwrap();
    std::os::unix::fs::symlink(dir.join("text"), dir.join("link")).unwrap();
    let corpus = load_within_a_minute(&dir.join("link")).unwrap();
    assert_eq!([corpus.train().bytes().unwrap(), corpus.validation().bytes().unwrap()].concat(), text);
    std::fs::remove_dir_all(dir).unwrap();
}
