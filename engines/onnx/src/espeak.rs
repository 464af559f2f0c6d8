//! espeak-ng phonemisation (speech request → phonemes, inside `speech_open`): text becomes
//! IPA phonemes clause by clause, with the punctuation that ended each clause, as Piper voices
//! were trained on.
//!
//! espeak-ng is opened with `libloading` rather than linked through a `-sys` crate: the
//! library ships in a wheel or beside the plugin, not on the build machine, and the plugin
//! needs three of its functions. Upstream espeak-ng has no call that reports a clause's
//! terminator (Piper's fork adds one), and its `espeak_TextToPhonemes` drops punctuation, so
//! the text is cut into clauses here ([`split_clauses`], at the punctuation espeak-ng ends a
//! clause at) and each clause is phonemised on its own. espeak-ng keeps global state: one
//! phonemiser per process, behind a mutex.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::Path;
use std::sync::{Mutex, OnceLock};

/// `espeak_AUDIO_OUTPUT::AUDIO_OUTPUT_SYNCHRONOUS`: no audio thread.
const AUDIO_OUTPUT_SYNCHRONOUS: c_int = 2;
/// `espeakINITIALIZE_DONT_EXIT`: return errors instead of exiting the process.
const INITIALIZE_DONT_EXIT: c_int = 0x8000;
/// `espeakCHARS_UTF8`.
const CHARS_UTF8: c_int = 1;
/// `espeakPHONEMES_IPA`.
const PHONEMES_IPA: c_int = 0x02;
/// `espeakPHONEMES_TIE`: bits 8–23 hold a character that ties the letters of one phoneme.
const PHONEMES_TIE: c_int = 0x80;
/// The tie [`phonemize`] asks for when `tied`: `a^ɪ` is one diphthong, `aɪ` two vowels.
pub const TIE: char = '^';

type InitializeFn = unsafe extern "C" fn(c_int, c_int, *const c_char, c_int) -> c_int;
type SetVoiceByNameFn = unsafe extern "C" fn(*const c_char) -> c_int;
type TextToPhonemesFn = unsafe extern "C" fn(*mut *const c_void, c_int, c_int) -> *const c_char;

/// One clause: its phonemes, the punctuation that ended it (if any), and whether it ended a
/// sentence.
#[derive(Clone, Debug, PartialEq)]
pub struct Clause {
    pub phonemes: String,
    pub terminator: Option<char>,
    pub ends_sentence: bool,
}

struct Espeak {
    set_voice: SetVoiceByNameFn,
    to_phonemes: TextToPhonemesFn,
    /// The voice set last (setting it again reloads its dictionary).
    voice: Option<String>,
    _lib: libloading::Library,
}

static ESPEAK: OnceLock<Result<Mutex<Espeak>, String>> = OnceLock::new();

/// Open and initialise espeak-ng once per process.
pub fn init(lib: &Path, data: &Path) -> Result<(), String> {
    ESPEAK
        .get_or_init(|| open(lib, data).map(Mutex::new))
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
}

fn open(lib: &Path, data: &Path) -> Result<Espeak, String> {
    // SAFETY: loading espeak-ng runs no initialiser with preconditions of ours.
    let l = unsafe { libloading::Library::new(lib) }
        .map_err(|e| format!("cannot open espeak-ng {}: {e}", lib.display()))?;
    // SAFETY: the symbols have these C signatures in every espeak-ng since 1.49
    // (speak_lib.h); the function pointers are used only while `_lib` keeps the library open.
    let (init, set_voice, to_phonemes) = unsafe {
        let sym = |name: &[u8]| {
            format!(
                "espeak-ng {}: no {}",
                lib.display(),
                String::from_utf8_lossy(name)
            )
        };
        (
            *l.get::<InitializeFn>(b"espeak_Initialize\0")
                .map_err(|_| sym(b"espeak_Initialize"))?,
            *l.get::<SetVoiceByNameFn>(b"espeak_SetVoiceByName\0")
                .map_err(|_| sym(b"espeak_SetVoiceByName"))?,
            *l.get::<TextToPhonemesFn>(b"espeak_TextToPhonemes\0")
                .map_err(|_| sym(b"espeak_TextToPhonemes"))?,
        )
    };
    let path = CString::new(data.as_os_str().as_encoded_bytes())
        .map_err(|_| "espeak-ng data path has a NUL byte".to_string())?;
    // SAFETY: the path is NUL-terminated and outlives the call; synchronous mode starts no
    // thread; DONT_EXIT makes a missing data directory an error return.
    let rate = unsafe {
        init(
            AUDIO_OUTPUT_SYNCHRONOUS,
            0,
            path.as_ptr(),
            INITIALIZE_DONT_EXIT,
        )
    };
    if rate <= 0 {
        return Err(format!(
            "espeak-ng could not initialise with data {} (status {rate})",
            data.display()
        ));
    }
    Ok(Espeak {
        set_voice,
        to_phonemes,
        voice: None,
        _lib: l,
    })
}

/// The clauses of `text` in espeak-ng `voice` (`en-us`, ...); with `tied`, the letters of
/// each multi-letter phoneme joined by [`TIE`] (Piper voices were trained without).
pub fn phonemize(voice: &str, text: &str, tied: bool) -> Result<Vec<Clause>, String> {
    let cell = ESPEAK
        .get()
        .ok_or("espeak-ng is not initialised")?
        .as_ref()
        .map_err(Clone::clone)?;
    let mut e = cell.lock().unwrap_or_else(|p| p.into_inner());
    if e.voice.as_deref() != Some(voice) {
        let v = CString::new(voice).map_err(|_| "the espeak voice has a NUL byte")?;
        // SAFETY: NUL-terminated name valid for the call; the mutex serialises espeak's state.
        let status = unsafe { (e.set_voice)(v.as_ptr()) };
        if status != 0 {
            return Err(format!(
                "espeak-ng has no voice {voice:?} (status {status})"
            ));
        }
        e.voice = Some(voice.to_string());
    }
    let mut clauses = Vec::new();
    for (text, terminator) in split_clauses(text) {
        let mode = if tied {
            PHONEMES_IPA | PHONEMES_TIE | ((TIE as c_int) << 8)
        } else {
            PHONEMES_IPA
        };
        let phonemes = to_phonemes(&e, text, mode);
        clauses.push(Clause {
            phonemes,
            terminator,
            ends_sentence: matches!(terminator, Some('.' | '?' | '!')),
        });
    }
    if let Some(last) = clauses.last_mut() {
        last.ends_sentence = true;
    }
    Ok(clauses)
}

/// All phonemes of one clause's text, the pieces espeak-ng returns joined by spaces.
fn to_phonemes(e: &Espeak, text: &str, mode: c_int) -> String {
    // Interior NULs would end the text early: they are not speech anyway.
    let text = CString::new(text.replace('\0', " ")).unwrap_or_default();
    let mut ptr: *const c_void = text.as_ptr().cast();
    let mut parts: Vec<String> = Vec::new();
    while !ptr.is_null() {
        // SAFETY: `ptr` points into `text` (NUL-terminated, alive for the loop); espeak-ng
        // advances it, or sets it to null at the end; the caller holds the mutex.
        let out = unsafe { (e.to_phonemes)(&mut ptr, CHARS_UTF8, mode) };
        if out.is_null() {
            break;
        }
        // SAFETY: espeak-ng returns a NUL-terminated string in its own buffer, valid until
        // its next call; copied at once.
        let s = unsafe { CStr::from_ptr(out) }
            .to_string_lossy()
            .trim()
            .to_string();
        if !s.is_empty() {
            parts.push(s);
        }
    }
    parts.join(" ")
}

/// Where espeak-ng ends a clause: `.` `,` `?` `!` `:` `;` followed by white space or the end
/// of the text (closing quotes and brackets may come between), so `3.5` and `e.g.x` stay
/// whole. Each clause's text with its terminator (the last of a run such as `?!`), or `None`
/// for the text after the last one.
pub fn split_clauses(text: &str) -> Vec<(&str, Option<char>)> {
    let is_term = |c: char| matches!(c, '.' | ',' | '?' | '!' | ':' | ';');
    let is_close = |c: char| matches!(c, '"' | '\'' | ')' | ']' | '}' | '\u{201d}' | '\u{2019}');
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < chars.len() {
        let (at, c) = chars[i];
        if !is_term(c) {
            i += 1;
            continue;
        }
        let mut j = i;
        while j + 1 < chars.len() && is_term(chars[j + 1].1) {
            j += 1;
        }
        let mut k = j + 1;
        while k < chars.len() && is_close(chars[k].1) {
            k += 1;
        }
        if k == chars.len() || chars[k].1.is_whitespace() {
            let words = text[start..at].trim();
            if !words.is_empty() {
                out.push((words, Some(chars[j].1)));
            }
            start = chars.get(k).map_or(text.len(), |&(b, _)| b);
        }
        i = k.max(i + 1);
    }
    let rest = text[start..].trim();
    if !rest.is_empty() {
        out.push((rest, None));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::split_clauses;

    #[test]
    fn clauses_end_at_punctuation_before_a_space() {
        assert_eq!(
            split_clauses("Hello, world. It costs 3.5 dollars?! \"Yes.\" Bye"),
            [
                ("Hello", Some(',')),
                ("world", Some('.')),
                ("It costs 3.5 dollars", Some('!')),
                ("\"Yes", Some('.')),
                ("Bye", None),
            ]
        );
        assert_eq!(split_clauses("..."), []);
        assert_eq!(split_clauses("  "), []);
    }
}
