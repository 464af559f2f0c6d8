//! Tool calls, incremental JSON scanning: where a bracketed value ends in text that is still
//! arriving, and where a marker starts outside JSON strings.

/// Follows JSON text one character at a time, far enough to tell where a
/// bracketed value ends: strings (with escapes) are skipped, brackets counted.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct JsonScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    /// Take one character; true when it closes the outermost bracket.
    pub(super) fn step(&mut self, c: char) -> bool {
        if self.in_string {
            self.step_in_string(c);
            return false;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }

    pub(super) fn step_in_string(&mut self, c: char) {
        if self.escaped {
            self.escaped = false;
        } else if c == '\\' {
            self.escaped = true;
        } else if c == '"' {
            self.in_string = false;
        }
    }

    /// Outside every string and bracket.
    pub(super) fn at_top(&self) -> bool {
        !self.in_string && self.depth == 0
    }
}

/// Feed `text[from..]` to `scan`; the offset just past the closing bracket,
/// if it came.
pub(super) fn scan_until_closed(text: &str, from: usize, scan: &mut JsonScan) -> Option<usize> {
    text[from..]
        .char_indices()
        .find(|&(_, c)| scan.step(c))
        .map(|(i, c)| from + i + c.len_utf8())
}

/// Waits, in held text, for a bracketed JSON value that starts (after
/// whitespace) at `from`, remembering how far it has read.
#[derive(Clone, Copy, Debug)]
pub(super) struct JsonWatch {
    from: usize,
    start: Option<usize>,
    pos: usize,
    scan: JsonScan,
}

/// What a [`JsonWatch`] has seen so far.
pub(super) enum Watch {
    /// More text is needed.
    Wait,
    /// Something other than the expected bracket came first.
    NotJson,
    /// The value is `text[start..end]`.
    Closed { start: usize, end: usize },
}

impl JsonWatch {
    pub(super) fn new(from: usize) -> Self {
        JsonWatch {
            from,
            start: None,
            pos: from,
            scan: JsonScan::default(),
        }
    }

    pub(super) fn advance(&mut self, text: &str, open: char) -> Watch {
        let start = match self.start {
            Some(start) => start,
            None => match first_non_space(text, self.from) {
                None => return Watch::Wait,
                Some((at, c)) if c == open => {
                    self.start = Some(at);
                    self.pos = at;
                    at
                }
                Some(_) => return Watch::NotJson,
            },
        };
        match scan_until_closed(text, self.pos, &mut self.scan) {
            Some(end) => Watch::Closed { start, end },
            None => {
                self.pos = text.len();
                Watch::Wait
            }
        }
    }
}

pub(super) fn first_non_space(text: &str, from: usize) -> Option<(usize, char)> {
    text[from..]
        .char_indices()
        .find(|(_, c)| !c.is_whitespace())
        .map(|(i, c)| (from + i, c))
}

/// Where `marker` starts in `text[from..]`, outside JSON strings.
pub(super) enum Search {
    Found(usize),
    /// Not yet; resume from this offset when more text comes.
    Wait(usize),
}

pub(super) fn find_outside_strings(
    text: &str,
    from: usize,
    scan: &mut JsonScan,
    marker: &str,
) -> Search {
    for (i, c) in text[from..].char_indices() {
        let at = from + i;
        if !scan.in_string && marker.starts_with(c) {
            let rest = &text[at..];
            if rest.starts_with(marker) {
                return Search::Found(at);
            }
            if marker.starts_with(rest) {
                return Search::Wait(at);
            }
        }
        scan.step(c);
    }
    Search::Wait(text.len())
}

/// Length of the longest end of `text` that could still grow into `marker`.
pub(super) fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            let at = text.len() - n;
            text.is_char_boundary(at) && marker.starts_with(&text[at..])
        })
        .unwrap_or(0)
}

pub(super) fn leading_whitespace_len(text: &str) -> usize {
    text.len() - text.trim_start().len()
}
