//! [`Vars`]: where variables are looked up (the process environment, the only place ferrogloo
//! reads it, or a lookup function), and the typed readers every module reads its variables
//! with: text, paths, switches, numbers, durations, addresses, and values of the modules' own
//! types (transports, launchers); each error names the variable and its value.

use crate::error::{Error, Result};
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

/// Where variables come from: this process's environment ([`Vars::process`]) or a lookup
/// ([`Vars::lookup`]: a map in tests, the variables a launcher plans to set). See the
/// [module](super) for the rules every reader follows.
#[derive(Clone, Copy)]
pub(crate) struct Vars<'a>(Source<'a>);

#[derive(Clone, Copy)]
enum Source<'a> {
    Process,
    Lookup(&'a dyn Fn(&str) -> Option<String>),
}

impl std::fmt::Debug for Vars<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Source::Process => "Vars(process environment)",
            Source::Lookup(_) => "Vars(lookup)",
        })
    }
}

/// The error for `name`, set to `value`, that is not `what` (`FERROGLOO_TIMEOUT="x" is not a
/// positive number of seconds`).
fn not(name: &str, value: &str, what: &str) -> Error {
    Error::invalid(format!("{name}={value:?} is not {what}"))
}

impl Vars<'static> {
    /// This process's environment.
    pub(crate) fn process() -> Self {
        Vars(Source::Process)
    }
}

impl<'a> Vars<'a> {
    /// The variables `lookup` gives.
    pub(crate) fn lookup(lookup: &'a dyn Fn(&str) -> Option<String>) -> Self {
        Vars(Source::Lookup(lookup))
    }

    /// `name`'s value as set (white space kept: for secrets and paths); `None` when unset,
    /// empty or, in the process environment, not Unicode.
    pub(crate) fn raw(&self, name: &str) -> Option<String> {
        let value = match self.0 {
            Source::Process => std::env::var(name).ok(),
            Source::Lookup(lookup) => lookup(name),
        };
        value.filter(|v| !v.is_empty())
    }

    /// `name`'s value without the white space around it; `None` when that leaves nothing.
    pub(crate) fn text(&self, name: &str) -> Option<String> {
        self.raw(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
    }

    /// Whether `name` is set (to something other than white space).
    pub(crate) fn is_set(&self, name: &str) -> bool {
        self.text(name).is_some()
    }

    /// `name`'s value as a path (taken as it is).
    pub(crate) fn path(&self, name: &str) -> Option<PathBuf> {
        self.raw(name).map(PathBuf::from)
    }

    /// `name`'s value, or an error saying it is not set and `hint` (what sets it).
    pub(crate) fn required(&self, name: &str, hint: &str) -> Result<String> {
        self.text(name).ok_or_else(|| Error::invalid(format!("{name} is not set ({hint})")))
    }

    /// Whether `name` is `1`: anything else, or nothing, is off.
    pub(crate) fn is_one(&self, name: &str) -> bool {
        self.text(name).as_deref() == Some("1")
    }

    /// Whether `name` is on in Horovod's way: `1`, `true`, `yes` or `on`; anything else, or
    /// nothing, is off.
    pub(crate) fn truthy(&self, name: &str) -> bool {
        matches!(self.text(name).as_deref(), Some("1" | "true" | "yes" | "on"))
    }

    /// `name` as a switch: `1`, `true`, `yes` or `on` is on; `0`, `false`, `no` or `off` is
    /// off; unset is `None`; anything else is an error naming the variable and its value.
    pub(crate) fn switch(&self, name: &str) -> Result<Option<bool>> {
        match self.text(name).as_deref() {
            None => Ok(None),
            Some("1" | "true" | "yes" | "on") => Ok(Some(true)),
            Some("0" | "false" | "no" | "off") => Ok(Some(false)),
            Some(v) => Err(not(name, v, "1 or 0 (true or false, yes or no, on or off)")),
        }
    }

    /// `Some(true)` when `name` is `1`, `Some(false)` when it is `0`, else (unset, or another
    /// value) `None`: the caller decides.
    pub(crate) fn on_off(&self, name: &str) -> Option<bool> {
        match self.text(name).as_deref() {
            Some("1") => Some(true),
            Some("0") => Some(false),
            _ => None,
        }
    }

    /// `name`'s value parsed as a `T` (a number, an address); a value that does not parse is
    /// an error saying it is not `what`.
    pub(crate) fn parse<T: FromStr>(&self, name: &str, what: &str) -> Result<Option<T>> {
        match self.raw(name) {
            Some(v) if !v.trim().is_empty() => v.trim().parse().map(Some).map_err(|_| not(name, &v, what)),
            _ => Ok(None),
        }
    }

    /// [`Vars::parse`], with what `name` must be given; an error says it is not set and `hint`.
    pub(crate) fn parse_required<T: FromStr>(&self, name: &str, what: &str, hint: &str) -> Result<T> {
        let v = self.required(name, hint)?;
        v.parse().map_err(|_| not(name, &self.raw(name).unwrap_or(v), what))
    }

    /// `name`'s value parsed by `T`'s own parser, whose error says why it does not parse (a
    /// transport, a launcher): `NAME="value": why`.
    pub(crate) fn parse_own<T: FromStr<Err = Error>>(&self, name: &str) -> Result<Option<T>> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) if v.trim().is_empty() => Ok(None),
            Some(v) => v.trim().parse().map(Some).map_err(|e: Error| {
                let why = match e {
                    Error::InvalidArgument(why) => why,
                    other => other.to_string(),
                };
                Error::invalid(format!("{name}={v:?}: {why}"))
            }),
        }
    }

    /// `name`'s value as a number that `accept`s, else an error saying it is not `what`.
    pub(crate) fn number(&self, name: &str, accept: impl Fn(f64) -> bool, what: &str) -> Result<Option<f64>> {
        match self.parse::<f64>(name, what)? {
            Some(x) if x.is_finite() && accept(x) => Ok(Some(x)),
            Some(_) => Err(not(name, &self.raw(name).unwrap_or_default(), what)),
            None => Ok(None),
        }
    }

    /// `name`'s value as a number of seconds (fractions allowed) that `accept`s, else an error
    /// saying it is not `what`.
    pub(crate) fn seconds(&self, name: &str, accept: impl Fn(f64) -> bool, what: &str) -> Result<Option<Duration>> {
        match self.number(name, accept, what)? {
            Some(s) => Duration::try_from_secs_f64(s)
                .map(Some)
                .map_err(|_| not(name, &self.raw(name).unwrap_or_default(), what)),
            None => Ok(None),
        }
    }

    /// `name`'s value as an IP address.
    pub(crate) fn ip(&self, name: &str) -> Result<Option<IpAddr>> {
        self.parse(name, "an IP address")
    }
}
