//! The armed half of [`crate::failpoint`], compiled only with the `failpoints` cargo feature:
//! the registry of armed points, the `CSI_AGENT_FAILPOINTS` parser and the hit counters.
//!
//! It must not be reachable from a release build: nothing here is compiled without the
//! feature, so no environment variable can make a production daemon kill itself.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use super::{ENV_VAR, FailpointError, SpecError};

/// What an armed failpoint does when it fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Kill the process at once (`SIGKILL` to itself), simulating `kill -9` or a power cut as
    /// far as this process is concerned.
    Exit,
    /// Make [`hit`] return an error.
    Error,
    /// Block the calling thread for this long, then carry on.
    Sleep(Duration),
}

/// An action and when it fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trigger {
    pub action: Action,
    /// `None`: fire on every hit. `Some(n)`: fire on the n-th hit after arming (1-based) only.
    pub nth: Option<u64>,
}

impl Trigger {
    /// Fires on every hit.
    pub fn always(action: Action) -> Self {
        Self { action, nth: None }
    }
}

/// One armed point and how many hits it has seen since it was armed.
#[derive(Clone, Copy, Debug)]
struct Armed {
    trigger: Trigger,
    seen: u64,
}

impl Armed {
    fn new(trigger: Trigger) -> Self {
        Self { trigger, seen: 0 }
    }

    /// Counts one hit and says whether to act.
    fn fire(&mut self) -> Option<Action> {
        self.seen = self.seen.saturating_add(1);
        match self.trigger.nth {
            None => Some(self.trigger.action),
            Some(n) if n == self.seen => Some(self.trigger.action),
            Some(_) => None,
        }
    }
}

#[derive(Debug)]
struct State {
    env_loaded: bool,
    counting: bool,
    local_arms: usize,
    armed: BTreeMap<String, Armed>,
    hits: BTreeMap<String, u64>,
}

impl State {
    fn active(&self) -> bool {
        self.counting || self.local_arms > 0 || !self.armed.is_empty()
    }

    /// Reads the environment once per process (unless [`init_from_env`] already did).
    fn load_env_once(&mut self) {
        if self.env_loaded {
            return;
        }
        self.env_loaded = true;
        let Ok(spec) = std::env::var(ENV_VAR) else {
            return;
        };
        match parse_spec(&spec) {
            Ok(entries) => self.apply(entries),
            Err(err) => tracing::error!(%err, "ignoring {ENV_VAR}"),
        }
    }

    fn apply(&mut self, entries: Vec<(String, Option<Trigger>)>) {
        for (name, trigger) in entries {
            match trigger {
                Some(trigger) => {
                    self.armed.insert(name, Armed::new(trigger));
                }
                None => {
                    self.armed.remove(&name);
                }
            }
        }
    }
}

static STATE: Mutex<State> = Mutex::new(State {
    env_loaded: false,
    counting: false,
    local_arms: 0,
    armed: BTreeMap::new(),
    hits: BTreeMap::new(),
});

/// True while any point may fire or hits are counted. It starts true so that the first
/// [`hit`] takes the slow path once and reads the environment there; afterwards it is kept
/// equal to `State::active()` (updated under the `STATE` lock).
static ACTIVE: AtomicBool = AtomicBool::new(true);

thread_local! {
    static LOCAL: RefCell<BTreeMap<String, Armed>> = const { RefCell::new(BTreeMap::new()) };
}

fn state() -> MutexGuard<'static, State> {
    // A panic while holding the lock cannot leave the maps half-updated in a way that matters
    // (each operation is a single insert/remove), so a poisoned lock is still usable.
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Updates [`ACTIVE`] after a change; the caller holds the lock.
fn publish(state: &State) {
    ACTIVE.store(state.active(), Ordering::Relaxed);
}

/// Marks a named point. Inert (one relaxed atomic load) unless something is armed; otherwise
/// counts the hit and performs the armed action, if any, for this name.
#[inline]
pub fn hit(name: &str) -> Result<(), FailpointError> {
    // Relaxed is enough: arming happens-before the code under test through whatever started
    // it (thread spawn, channel, lock); a hit racing with arming may go either way.
    if !ACTIVE.load(Ordering::Relaxed) {
        return Ok(());
    }
    hit_slow(name)
}

#[cold]
#[inline(never)]
fn hit_slow(name: &str) -> Result<(), FailpointError> {
    let action = {
        let mut state = state();
        state.load_env_once();
        publish(&state);
        if state.active() {
            match state.hits.get_mut(name) {
                Some(count) => *count = count.saturating_add(1),
                None => {
                    state.hits.insert(name.to_owned(), 1);
                }
            }
        }
        // A thread-local arm takes precedence over a global one for the same name.
        let local = if state.local_arms > 0 {
            LOCAL.with(|local| local.borrow_mut().get_mut(name).map(|armed| armed.fire()))
        } else {
            None
        };
        match local {
            Some(action) => action,
            None => state.armed.get_mut(name).and_then(Armed::fire),
        }
    };
    match action {
        None => Ok(()),
        Some(Action::Error) => Err(FailpointError {
            name: name.to_owned(),
        }),
        Some(Action::Sleep(duration)) => {
            std::thread::sleep(duration);
            Ok(())
        }
        Some(Action::Exit) => die(name),
    }
}

/// Kills the process like `kill -9` would.
fn die(name: &str) -> ! {
    // stderr is unbuffered: this line is the only trace a crash test leaves for a human.
    eprintln!("failpoint {name}: exit (SIGKILL to self)");
    // SIGKILL cannot be caught and is acted on before kill(2) returns to this thread, so no
    // destructor, atexit handler or stdio flush runs. abort() is the fallback should the
    // signal somehow not be delivered (it also skips destructors, but may dump core).
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    std::process::abort()
}

/// Arms `name` to perform `action` on every hit, process-wide.
pub fn arm(name: &str, action: Action) {
    arm_trigger(name, Trigger::always(action));
}

/// Arms `name` to perform `action` on its `nth` hit (1-based) only, process-wide.
pub fn arm_nth(name: &str, nth: u64, action: Action) {
    arm_trigger(
        name,
        Trigger {
            action,
            nth: Some(nth.max(1)),
        },
    );
}

fn arm_trigger(name: &str, trigger: Trigger) {
    let mut state = state();
    // Arming programmatically still honours the environment for the other names.
    state.load_env_once();
    state.armed.insert(name.to_owned(), Armed::new(trigger));
    publish(&state);
}

/// Disarms one process-wide point (thread-local arms are left to their guards).
pub fn disarm(name: &str) {
    let mut state = state();
    state.load_env_once();
    state.armed.remove(name);
    publish(&state);
}

/// Disarms every process-wide point, including those armed from the environment.
pub fn disarm_all() {
    let mut state = state();
    // Mark the environment as read so that a later first hit does not re-arm it.
    state.env_loaded = true;
    state.armed.clear();
    publish(&state);
}

/// Turns hit counting on or off independently of arming.
pub fn count_hits(enable: bool) {
    let mut state = state();
    state.counting = enable;
    publish(&state);
}

/// How many times `name` was hit while counting was on (anything armed, or [`count_hits`]).
pub fn hits(name: &str) -> u64 {
    state().hits.get(name).copied().unwrap_or(0)
}

/// Parses [`ENV_VAR`] and arms what it names (adding to what is armed already). An absent or
/// empty variable arms nothing. Returns the first malformed entry as an error and then arms
/// nothing from the variable.
pub fn init_from_env() -> Result<(), SpecError> {
    let spec = match std::env::var(ENV_VAR) {
        Ok(spec) => spec,
        Err(std::env::VarError::NotPresent) => String::new(),
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(SpecError {
                entry: ENV_VAR.to_owned(),
                reason: "the variable is not valid UTF-8".to_owned(),
            });
        }
    };
    let entries = parse_spec(&spec);
    let mut state = state();
    state.env_loaded = true;
    let entries = entries?;
    state.apply(entries);
    publish(&state);
    Ok(())
}

/// Arms everything named in a spec in [`ENV_VAR`] syntax. All or nothing.
pub fn arm_from_spec(spec: &str) -> Result<(), SpecError> {
    let entries = parse_spec(spec)?;
    let mut state = state();
    state.load_env_once();
    state.apply(entries);
    publish(&state);
    Ok(())
}

/// Parses `name=[N*]action` entries separated by `;`. Whitespace around entries, names and
/// actions is ignored, and so are empty entries (a trailing `;`). `None` means `off`.
pub fn parse_spec(spec: &str) -> Result<Vec<(String, Option<Trigger>)>, SpecError> {
    let mut out = Vec::new();
    for raw in spec.split(';') {
        let entry = raw.trim();
        if entry.is_empty() {
            continue;
        }
        let bad = |reason: &str| SpecError {
            entry: entry.to_owned(),
            reason: reason.to_owned(),
        };
        let Some((name, action)) = entry.split_once('=') else {
            return Err(bad("expected `name=action`"));
        };
        let name = name.trim();
        if name.is_empty() {
            return Err(bad("empty failpoint name"));
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(bad(
                "a failpoint name may contain only letters, digits, `.`, `_` and `-`",
            ));
        }
        let action = action.trim();
        let (nth, action) = match action.split_once('*') {
            Some((count, rest)) => {
                let count: u64 = count
                    .trim()
                    .parse()
                    .map_err(|_| bad("the count before `*` must be a positive integer"))?;
                if count == 0 {
                    return Err(bad("the count before `*` must be at least 1"));
                }
                (Some(count), rest.trim())
            }
            None => (None, action),
        };
        let action = match action {
            "off" if nth.is_none() => None,
            "off" => return Err(bad("`off` takes no count")),
            "exit" => Some(Action::Exit),
            "error" => Some(Action::Error),
            other => match other
                .strip_prefix("sleep(")
                .and_then(|rest| rest.strip_suffix(')'))
            {
                Some(ms) => {
                    let ms: u64 = ms
                        .trim()
                        .parse()
                        .map_err(|_| bad("sleep takes whole milliseconds, e.g. `sleep(50)`"))?;
                    Some(Action::Sleep(Duration::from_millis(ms)))
                }
                None => {
                    return Err(bad(
                        "unknown action (expected `exit`, `error`, `sleep(MS)` or `off`, optionally prefixed by `N*`)",
                    ));
                }
            },
        };
        out.push((
            name.to_owned(),
            action.map(|action| Trigger { action, nth }),
        ));
    }
    Ok(out)
}

/// Disarms a thread-local failpoint when dropped. See [`arm_local`].
#[derive(Debug)]
#[must_use = "the failpoint is disarmed when the guard is dropped"]
pub struct LocalGuard {
    name: String,
    // The thread-local map lives on the arming thread: the guard must stay there.
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Arms `name` on the calling thread only, on every hit, until the guard is dropped.
pub fn arm_local(name: &str, action: Action) -> LocalGuard {
    arm_local_trigger(name, Trigger::always(action))
}

/// Arms `name` on the calling thread only, firing on its `nth` hit on this thread.
pub fn arm_local_nth(name: &str, nth: u64, action: Action) -> LocalGuard {
    arm_local_trigger(
        name,
        Trigger {
            action,
            nth: Some(nth.max(1)),
        },
    )
}

fn arm_local_trigger(name: &str, trigger: Trigger) -> LocalGuard {
    let replaced = LOCAL.with(|local| {
        local
            .borrow_mut()
            .insert(name.to_owned(), Armed::new(trigger))
            .is_some()
    });
    let mut state = state();
    state.load_env_once();
    if !replaced {
        state.local_arms += 1;
    }
    publish(&state);
    LocalGuard {
        name: name.to_owned(),
        _not_send: std::marker::PhantomData,
    }
}

impl Drop for LocalGuard {
    fn drop(&mut self) {
        let removed = LOCAL
            .try_with(|local| local.borrow_mut().remove(&self.name).is_some())
            .unwrap_or(false);
        if removed {
            let mut state = state();
            state.local_arms = state.local_arms.saturating_sub(1);
            publish(&state);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::process::Command;

    // Every test uses names of its own: tests run in parallel in one process.

    #[test]
    fn unarmed_point_is_a_no_op() {
        assert_eq!(hit("failpoint.test.never_armed"), Ok(()));
        assert_eq!(hit("failpoint.test.never_armed"), Ok(()));
    }

    #[test]
    fn error_action_returns_an_error_until_disarmed() {
        arm("failpoint.test.error", Action::Error);
        let err = hit("failpoint.test.error").unwrap_err();
        assert_eq!(err.name, "failpoint.test.error");
        assert!(err.to_string().contains("failpoint.test.error"));
        assert!(hit("failpoint.test.error").is_err());
        assert!(hits("failpoint.test.error") >= 2);
        disarm("failpoint.test.error");
        assert_eq!(hit("failpoint.test.error"), Ok(()));
    }

    #[test]
    fn nth_hit_fires_once() {
        arm_nth("failpoint.test.nth", 2, Action::Error);
        assert_eq!(hit("failpoint.test.nth"), Ok(()));
        assert!(hit("failpoint.test.nth").is_err());
        assert_eq!(hit("failpoint.test.nth"), Ok(()));
        disarm("failpoint.test.nth");
    }

    #[test]
    fn sleep_action_delays() {
        arm(
            "failpoint.test.sleep",
            Action::Sleep(Duration::from_millis(30)),
        );
        let start = std::time::Instant::now();
        assert_eq!(hit("failpoint.test.sleep"), Ok(()));
        assert!(start.elapsed() >= Duration::from_millis(30));
        disarm("failpoint.test.sleep");
    }

    #[test]
    fn local_arm_fires_only_on_its_thread() {
        let guard = arm_local("failpoint.test.local", Action::Error);
        assert!(hit("failpoint.test.local").is_err());
        let other = std::thread::spawn(|| hit("failpoint.test.local"))
            .join()
            .unwrap();
        assert_eq!(other, Ok(()));
        drop(guard);
        assert_eq!(hit("failpoint.test.local"), Ok(()));
    }

    #[test]
    fn spec_parses_every_action() {
        let parsed =
            parse_spec(" a.b=exit; c_d = error ;e-f=sleep(50);g=2*error; h=off;;").unwrap();
        assert_eq!(
            parsed,
            vec![
                ("a.b".to_owned(), Some(Trigger::always(Action::Exit))),
                ("c_d".to_owned(), Some(Trigger::always(Action::Error))),
                (
                    "e-f".to_owned(),
                    Some(Trigger::always(Action::Sleep(Duration::from_millis(50))))
                ),
                (
                    "g".to_owned(),
                    Some(Trigger {
                        action: Action::Error,
                        nth: Some(2)
                    })
                ),
                ("h".to_owned(), None),
            ]
        );
        assert_eq!(parse_spec("").unwrap(), vec![]);
    }

    #[test]
    fn malformed_spec_names_the_bad_entry() {
        for (spec, bad_entry) in [
            ("a=exit;b", "b"),
            ("a=exit;b=explode", "b=explode"),
            ("=exit", "=exit"),
            ("a b=exit", "a b=exit"),
            ("a=sleep(x)", "a=sleep(x)"),
            ("a=sleep(5", "a=sleep(5"),
            ("a=0*exit", "a=0*exit"),
            ("a=x*exit", "a=x*exit"),
            ("ok=error; bad=2*off", "bad=2*off"),
        ] {
            let err = parse_spec(spec).unwrap_err();
            assert_eq!(err.entry, bad_entry, "{spec}");
            assert!(err.to_string().contains(bad_entry), "{err}");
        }
    }

    #[test]
    fn spec_arms_points() {
        arm_from_spec("failpoint.test.spec=error").unwrap();
        assert!(hit("failpoint.test.spec").is_err());
        arm_from_spec("failpoint.test.spec=off").unwrap();
        assert_eq!(hit("failpoint.test.spec"), Ok(()));
    }

    const CHILD_ENV: &str = "CSI_AGENT_FAILPOINT_TEST_CHILD";

    /// Runs only as the child of `exit_action_kills_the_process_at_once`; a no-op otherwise.
    #[test]
    fn exit_child() {
        if std::env::var_os(CHILD_ENV).is_none() {
            return;
        }
        init_from_env().unwrap();
        println!("child: before");
        hit("failpoint.test.exit").unwrap();
        println!("child: completed");
    }

    #[test]
    fn exit_action_kills_the_process_at_once() {
        use std::os::unix::process::ExitStatusExt;
        let output = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "failpoint::armed::tests::exit_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .env(ENV_VAR, "failpoint.test.exit=exit")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{stdout}\n{stderr}");
        assert_eq!(output.status.signal(), Some(9), "{stdout}\n{stderr}");
        assert!(!stdout.contains("child: completed"), "{stdout}");
        assert!(
            stderr.contains("failpoint failpoint.test.exit: exit"),
            "{stderr}"
        );
    }
}
