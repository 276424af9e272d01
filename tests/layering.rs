//! The layering of ARCHITECTURE.md's "Layers" section, checked on the `crate::` paths of
//! `src/` (tests and loom models left out, as there), and the rule that a function of
//! `src/` over 60 lines says why in a `// long:` comment above it.
//!
//! Plain text reading, no parser: comments, strings and `#[cfg(test)]` items are blanked
//! first, then every `crate::` path (in `use` lines or in code, grouped or not) is taken
//! to the module it names, root re-exports of `lib.rs` followed to their module.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// The layers from the top down, as ARCHITECTURE.md's "Layers" section lists them (the
/// boxes, and the order inside a box). A module may use only modules of a later row; the
/// modules of one row do not use each other (`adaptor` and `suballoc`; `driver` and the
/// small modules beside the bottom ones, which use at most `error` or `sync`).
const LAYERS: &[&[&str]] = &[
    &["spec"],
    &["container"],
    &["per_device"],
    &["layer"],
    &["adaptor", "suballoc"],
    &["upstream"],
    &["erased"],
    &["copy"],
    &["resource"],
    &["property"],
    &["stream"],
    &["device"],
    &[
        "driver",
        "addr_map",
        "log",
        "units",
        "profile",
        "cache_prefetch",
    ],
    &["platform"],
    &["error"],
    &["sync"],
];

/// The one pair ARCHITECTURE lets import each other, at file level a line: `error.rs`
/// uses `platform::ErrorCode` to name and describe a driver's result code (the platform
/// that returned it knows its names). (file under `src/`, the path it may use)
const ALLOWED_UPWARD: &[(&str, &str)] = &[("error.rs", "platform::ErrorCode")];

/// A function of `src/` longer than this (from its `fn` line to its closing brace) needs
/// a comment containing `long:` above it saying why.
const LONGEST_FUNCTION: usize = 60;

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, sorted, as (path relative to `src/`, text).
fn rust_files(dir: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .expect("src/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(src_dir()).expect("under src/");
            let rel = rel.to_string_lossy().replace('\\', "/");
            out.push((
                rel,
                fs::read_to_string(&path).expect("a source file is UTF-8"),
            ));
        }
    }
}

/// `text` with comments and the contents of string and char literals replaced by spaces
/// (newlines kept, so offsets and line numbers stay). Rough: enough for this crate.
fn blank_comments_and_strings(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = text[i..].find('\n').map_or(b.len(), |n| i + n);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                let mut j = i;
                while j < b.len() {
                    if b[j..].starts_with(b"/*") {
                        depth += 1;
                        j += 2;
                    } else if b[j..].starts_with(b"*/") {
                        depth -= 1;
                        j += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        j += 1;
                    }
                }
                blank(&mut out, i, j);
                i = j;
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !is_ident(b[i - 1])) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close = format!("\"{}", "#".repeat(hashes));
                let start = i + 2 + hashes;
                let end = text[start..].find(&close).map_or(b.len(), |n| start + n);
                blank(&mut out, start, end);
                i = end + close.len();
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, i + 1, j.min(b.len()));
                i = j + 1;
            }
            b'\'' => {
                // A char literal ('x', '\n', '"'), else a lifetime.
                if b.get(i + 1) == Some(&b'\\') {
                    let end = text[i + 2..].find('\'').map_or(b.len(), |n| i + 2 + n);
                    blank(&mut out, i + 1, end);
                    i = end + 1;
                } else if b.get(i + 2) == Some(&b'\'') {
                    blank(&mut out, i + 1, i + 2);
                    i += 3;
                } else {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The offset just past the brace that closes the one at `open`.
fn matching_brace(code: &str, open: usize) -> usize {
    let mut depth = 0usize;
    for (i, c) in code[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + i + 1;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// Blanks the items under a `#[cfg(..)]` that names `test` (inline test modules, test
/// helpers, test imports); returns the names of the `mod name;` files so marked.
fn blank_test_items(code: &mut String) -> Vec<String> {
    let mut test_files = Vec::new();
    let mut from = 0;
    while let Some(n) = code[from..].find("#[cfg(") {
        let at = from + n;
        let attr_end = at + code[at..].find(']').expect("an attribute closes");
        let attr = &code[at..attr_end];
        from = attr_end;
        let names_test = attr
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .any(|w| w == "test");
        if !names_test || attr.contains("not(test") {
            continue;
        }
        // The item: skip further attributes and a visibility.
        let mut rest = attr_end + 1;
        loop {
            let trimmed = code[rest..].trim_start();
            rest = code.len() - trimmed.len();
            if trimmed.starts_with("#[") {
                rest += trimmed.find(']').expect("an attribute closes") + 1;
            } else {
                break;
            }
        }
        let item = code[rest..]
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub ");
        let end = if let Some(decl) = item.strip_prefix("mod ") {
            let name: String = decl.chars().take_while(|&c| is_ident(c as u8)).collect();
            let after = decl[name.len()..].trim_start();
            if after.starts_with(';') {
                test_files.push(name);
                rest + code[rest..].find(';').expect("a declaration ends") + 1
            } else {
                matching_brace(code, rest + code[rest..].find('{').expect("a module body"))
            }
        } else if item.starts_with("use ") {
            rest + code[rest..].find(';').expect("a use ends") + 1
        } else if item.starts_with("fn ") || item.starts_with("impl") {
            matching_brace(code, rest + code[rest..].find('{').expect("a body"))
        } else {
            continue;
        };
        let blanked: String = code[at..end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        code.replace_range(at..end, &blanked);
        from = end;
    }
    test_files
}

/// The module path of a file: `suballoc/virtual_pool/grow.rs` → `suballoc::virtual_pool::grow`.
fn module_path(file: &str) -> Vec<String> {
    let stem = file.trim_end_matches(".rs");
    let mut parts: Vec<String> = stem.split('/').map(str::to_string).collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The layer row of a top-level module, if it is in [`LAYERS`].
fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|row| row.contains(&module))
}

/// The paths a `crate::` (or `super::`) whose rest starts at `at` names, each as (offset,
/// path after the crate root): `a::{b, c::D}` gives `a::b` and `a::c::D`; `{a::X, b}`
/// gives `a::X` and `b`.
fn paths_at(code: &str, at: usize, out: &mut Vec<(usize, String)>) {
    group_or_path(code, at, String::new(), out);
}

/// [`paths_at`] under `prefix` (the path of the group a piece is in).
fn group_or_path(code: &str, mut at: usize, prefix: String, out: &mut Vec<(usize, String)>) {
    let skip_ws = |at: usize| at + (code[at..].len() - code[at..].trim_start().len());
    at = skip_ws(at);
    let start = at;
    let mut path = prefix;
    loop {
        if code[at..].starts_with('{') {
            let end = matching_brace(code, at) - 1;
            let mut depth = 0;
            let mut piece = at + 1;
            for (i, c) in code[at + 1..end]
                .char_indices()
                .chain([(end - at - 1, ',')])
            {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        if !code[piece..at + 1 + i].trim().is_empty() {
                            group_or_path(code, piece, path.clone(), out);
                        }
                        piece = at + 2 + i;
                    }
                    _ => {}
                }
            }
            return;
        }
        let ident: String = code[at..]
            .chars()
            .take_while(|&c| is_ident(c as u8))
            .collect();
        if ident.is_empty() {
            break;
        }
        at += ident.len();
        if ident != "self" {
            if !path.is_empty() {
                path.push_str("::");
            }
            path.push_str(&ident);
        }
        let next = skip_ws(at);
        if code[next..].starts_with("::") {
            at = skip_ws(next + 2);
        } else {
            if code[next..].starts_with("as ") {
                let alias = skip_ws(next + 3);
                let name: String = code[alias..]
                    .chars()
                    .take_while(|&c| is_ident(c as u8))
                    .collect();
                path.push_str(&format!(" as {name}"));
            }
            break;
        }
    }
    if !path.is_empty() {
        out.push((start, path));
    }
}

/// The names `lib.rs` re-exports at the crate root, each with the module it comes from.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let code = blank_comments_and_strings(lib);
    let mut names = BTreeMap::new();
    let mut from = 0;
    while let Some(n) = code[from..].find("pub use ") {
        let at = from + n + "pub use ".len();
        let end = at + code[at..].find(';').expect("a use ends");
        let mut paths = Vec::new();
        paths_at(&code[..end], at, &mut paths);
        for (_, path) in paths {
            let module = path.split("::").next().expect("a module").to_string();
            let last = path.rsplit("::").next().expect("a name");
            let name = last
                .rsplit(" as ")
                .next()
                .expect("a name")
                .trim()
                .to_string();
            names.insert(name, module);
        }
        from = end;
    }
    names
}

struct Use {
    line: usize,
    path: String,
    module: String,
}

/// Every crate path `code` (of the file whose module path is `here`) names, resolved to
/// a top-level module.
fn crate_uses(code: &str, here: &[String], reexports: &BTreeMap<String, String>) -> Vec<Use> {
    let mut found = Vec::new();
    for prefix in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(n) = code[from..].find(prefix) {
            let at = from + n;
            from = at + prefix.len();
            let before = code[..at].bytes().last();
            if before.is_some_and(|c| is_ident(c) || c == b'$' || c == b':') {
                continue; // `$crate::`, `super::super::` (taken whole below), `x::crate`
            }
            // `super::super::..` leaving the top-level module: a path from the root.
            let mut at = at + prefix.len();
            if prefix == "super::" {
                let mut base = here.to_vec();
                base.pop();
                while code[at..].starts_with("super::") {
                    base.pop();
                    at += "super::".len();
                }
                if !base.is_empty() {
                    continue; // inside the same top-level module
                }
            }
            let mut paths = Vec::new();
            paths_at(code, at, &mut paths);
            for (offset, path) in paths {
                let first = path.split("::").next().unwrap_or("").to_string();
                let module = if layer_of(&first).is_some() {
                    first
                } else if let Some(module) = reexports.get(&first) {
                    module.clone()
                } else {
                    format!("?{first}")
                };
                let line = code[..offset].matches('\n').count() + 1;
                found.push(Use { line, path, module });
            }
        }
    }
    found
}

/// Every file of `src/` with its code (comments, strings and test items blanked), test
/// files left out.
fn library_code() -> Vec<(String, String, String)> {
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    let mut code: Vec<(String, String, String)> = Vec::new();
    let mut test_files = Vec::new();
    for (file, text) in files {
        let mut blanked = blank_comments_and_strings(&text);
        // The folder the file's `mod name;` declarations live in.
        let dir = if file.ends_with("/mod.rs") || file == "lib.rs" {
            file.rsplit_once('/').map_or("", |(d, _)| d).to_string()
        } else {
            file.trim_end_matches(".rs").to_string()
        };
        for name in blank_test_items(&mut blanked) {
            let under = if dir.is_empty() {
                name
            } else {
                format!("{dir}/{name}")
            };
            test_files.push(format!("{under}.rs"));
            test_files.push(format!("{under}/mod.rs"));
        }
        code.push((file, text, blanked));
    }
    code.retain(|(file, _, _)| !test_files.iter().any(|t| t == file));
    code
}

#[test]
fn no_module_uses_a_layer_above_it() {
    let lib = fs::read_to_string(src_dir().join("lib.rs")).expect("src/lib.rs");
    let reexports = root_reexports(&lib);
    let mut violations = Vec::new();
    let mut checked = 0;
    for (file, _, code) in library_code() {
        if file == "lib.rs" {
            continue; // the root declares and re-exports; it is in no layer
        }
        let here = module_path(&file);
        let module = &here[0];
        let Some(layer) = layer_of(module) else {
            violations.push(format!(
                "src/{file}: module `{module}` is in no layer of tests/layering.rs's LAYERS \
                 (add it there and to ARCHITECTURE.md's \"Layers\")"
            ));
            continue;
        };
        for u in crate_uses(&code, &here, &reexports) {
            checked += 1;
            if u.module == *module {
                continue;
            }
            if ALLOWED_UPWARD
                .iter()
                .any(|&(f, p)| f == file && u.path.starts_with(p))
            {
                continue;
            }
            let Some(used) = layer_of(u.module.trim_start_matches('?')) else {
                violations.push(format!(
                    "src/{file}:{}: `crate::{}` names `{}`, which is neither a module of \
                     LAYERS nor a root re-export",
                    u.line, u.path, u.module
                ));
                continue;
            };
            if used <= layer {
                let how = if used == layer {
                    "beside it (same row)"
                } else {
                    "above it"
                };
                violations.push(format!(
                    "src/{file}:{}: layer `{module}` uses `crate::{}` of layer `{}`, {how}",
                    u.line, u.path, u.module
                ));
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} crate paths found: is the reader broken?"
    );
    assert!(
        violations.is_empty(),
        "imports against ARCHITECTURE.md's \"Layers\" (a module uses only later rows of \
         LAYERS):\n{}",
        violations.join("\n")
    );
}

/// The functions of `code`: (line of `fn`, lines from it to the closing brace, name).
fn functions(code: &str) -> Vec<(usize, usize, String)> {
    let mut found = Vec::new();
    let b = code.as_bytes();
    let mut from = 0;
    while let Some(n) = code[from..].find("fn ") {
        let at = from + n;
        from = at + 3;
        if at > 0 && is_ident(b[at - 1]) {
            continue;
        }
        let name: String = code[at + 3..]
            .trim_start()
            .chars()
            .take_while(|&c| c.is_alphanumeric() || c == '_')
            .collect();
        if name.is_empty() {
            continue; // `fn(` pointer types
        }
        // The body: the first `{` before any `;` (a declaration without one has none).
        let rest = &code[at..];
        let (Some(open), semi) = (rest.find('{'), rest.find(';')) else {
            continue;
        };
        if semi.is_some_and(|s| s < open) {
            continue;
        }
        let close = matching_brace(code, at + open);
        let first = code[..at].matches('\n').count() + 1;
        let last = code[..close].matches('\n').count() + 1;
        found.push((first, last - first + 1, name));
    }
    found
}

/// Whether the comments and attributes just above line `line` (1-based) of `text` say
/// why the function is long (`long:`).
fn says_why_long(text: &str, line: usize) -> bool {
    let lines: Vec<&str> = text.lines().collect();
    let mut i = line - 1;
    while i > 0 {
        i -= 1;
        let l = lines[i].trim_start();
        if l.starts_with("//") {
            if l.contains("long:") {
                return true;
            }
        } else if !(l.starts_with("#[") || l.starts_with(')') || l.starts_with("///")) {
            return false;
        }
    }
    false
}

#[test]
fn long_functions_say_why() {
    let mut unexplained = Vec::new();
    let mut explained = 0;
    for (file, text, code) in library_code() {
        for (line, length, name) in functions(&code) {
            if length <= LONGEST_FUNCTION {
                continue;
            }
            if says_why_long(&text, line) {
                explained += 1;
            } else {
                unexplained.push(format!("src/{file}:{line}: fn {name}, {length} lines"));
            }
        }
    }
    assert!(
        unexplained.is_empty(),
        "functions over {LONGEST_FUNCTION} lines without a `// long: <why>` comment above \
         them ({explained} have one); split them or say why:\n{}",
        unexplained.join("\n")
    );
}

/// The start of every driver-API call outside `src/platform/`: CUDA's functions are
/// `cu` and a capital (`cuMemAlloc_v2(`), HIP's `hip` and a capital. (line, name)
fn driver_calls(code: &str) -> Vec<(usize, String)> {
    let b = code.as_bytes();
    let mut calls = Vec::new();
    for (at, _) in code.match_indices(['c', 'h']) {
        if at > 0 && is_ident(b[at - 1]) {
            continue;
        }
        let prefix = if code[at..].starts_with("cu") {
            2
        } else if code[at..].starts_with("hip") {
            3
        } else {
            continue;
        };
        if !b.get(at + prefix).is_some_and(u8::is_ascii_uppercase) {
            continue;
        }
        let end = at + b[at..].iter().take_while(|&&c| is_ident(c)).count();
        if code[end..].trim_start().starts_with('(') {
            let line = code[..at].matches('\n').count() + 1;
            calls.push((line, code[at..end].to_string()));
        }
    }
    calls
}

/// Every driver call goes through the platform seam (`src/platform/`, issue 50): a call of
/// a CUDA or HIP function anywhere else in `src/` fails here, naming the file and line.
#[test]
fn driver_calls_live_in_the_platform_seam() {
    let mut outside = Vec::new();
    let mut inside = 0;
    for (file, _, code) in library_code() {
        let calls = driver_calls(&code);
        if file.starts_with("platform/") {
            inside += calls.len();
            continue;
        }
        for (line, name) in calls {
            outside.push(format!("src/{file}:{line}: {name}(..)"));
        }
    }
    assert!(
        inside > 50,
        "the seam itself makes the driver calls ({inside} found)"
    );
    assert!(
        outside.is_empty(),
        "driver calls outside src/platform/ (make them a method of `platform::Platform`):\n{}",
        outside.join("\n")
    );
}
