//! An approval's answer that came before its question: the hook that asks
//! may tell its approver (a bot, say) before hookwire has recorded the
//! `ask`. Such an answer is held, for up to [`EARLY_ANSWER_HOLD`], and
//! tried again as soon as the store hints that the run's question was
//! recorded ([`crate::store::asked_hint`]), on this replica or another.
//! Polling alone would let a question with a short timeout expire between
//! two tries.

use std::future::Future;
use std::time::Duration;

use tokio::sync::broadcast::{self, error::RecvError};
use tokio::time::Instant;

use super::approvals::EARLY_ANSWER_HOLD;
use crate::store::REREAD_ALL;

/// The first pause between tries without a hint, doubled after each.
const FIRST_PAUSE: Duration = Duration::from_millis(5);
/// The longest pause between tries without a hint. Hints are not missed
/// unnoticed (a lagging receiver and a listener that lost its connection
/// both count as the hint), so the pauses are only a fallback, and a held
/// answer whose question never comes (a mistyped call id) costs about a
/// dozen store reads over its hold rather than one per 200 ms.
const LONGEST_PAUSE: Duration = Duration::from_secs(1);

/// Calls `attempt` until it finds the question (any result but an error
/// `not_asked` accepts) or [`EARLY_ANSWER_HOLD`] has passed since the
/// first call; then returns what the last call did. Between calls it waits
/// for `hint` on `hints` (subscribed before the first call, so a question
/// recorded meanwhile is not missed) or a pause, whichever comes first.
/// `on_hold` runs each time the answer is held.
pub async fn hold_for_question<T, E, Fut>(
    hints: &mut broadcast::Receiver<String>,
    hint: &str,
    mut attempt: impl FnMut() -> Fut,
    not_asked: impl Fn(&E) -> bool,
    mut on_hold: impl FnMut(),
) -> Result<T, E>
where
    Fut: Future<Output = Result<T, E>>,
{
    let held = Instant::now() + EARLY_ANSWER_HOLD;
    let mut pause = FIRST_PAUSE;
    loop {
        match attempt().await {
            Err(e) if not_asked(&e) && Instant::now() < held => {
                on_hold();
                until_hint(hints, hint, (Instant::now() + pause).min(held)).await;
                pause = (pause * 2).min(LONGEST_PAUSE);
            }
            done => return done,
        }
    }
}

/// Waits until `hint` arrives or `until`, whichever is first; hints lost
/// to a full channel, and [`REREAD_ALL`] (the store may have lost them),
/// count as the one awaited (the next try reads the store anyway).
async fn until_hint(hints: &mut broadcast::Receiver<String>, hint: &str, until: Instant) {
    let pause = tokio::time::sleep_until(until);
    tokio::pin!(pause);
    loop {
        tokio::select! {
            _ = &mut pause => return,
            h = hints.recv() => match h {
                Ok(h) if h == hint || h == REREAD_ALL => return,
                Ok(_) => {}
                Err(RecvError::Lagged(_)) => return,
                // A store without hints: the pause alone.
                Err(RecvError::Closed) => return pause.await,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    #[derive(Debug, PartialEq)]
    struct NotAsked;

    /// An answer whose store finds no question until `asked` is set.
    fn answer(
        asked: &Arc<AtomicBool>,
        tries: &Arc<AtomicUsize>,
    ) -> impl FnMut() -> std::future::Ready<Result<(), NotAsked>> {
        let (asked, tries) = (asked.clone(), tries.clone());
        move || {
            tries.fetch_add(1, Ordering::SeqCst);
            std::future::ready(if asked.load(Ordering::SeqCst) {
                Ok(())
            } else {
                Err(NotAsked)
            })
        }
    }

    /// The answer of run `r1`'s call, held in a task of its own.
    fn hold_in_background(
        mut hints: broadcast::Receiver<String>,
        asked: &Arc<AtomicBool>,
        tries: &Arc<AtomicUsize>,
    ) -> tokio::task::JoinHandle<Result<(), NotAsked>> {
        let mut attempt = answer(asked, tries);
        tokio::spawn(async move {
            hold_for_question(&mut hints, "asked:r1", &mut attempt, |_| true, || {}).await
        })
    }

    /// The question is recorded 400 ms after the answer came, when the
    /// pause between tries has grown to 320 ms: the answer is tried again
    /// at the hint, not at the next pause's end (635 ms), by which time an
    /// `ask` with a 50 ms timeout had already been denied.
    #[tokio::test(start_paused = true)]
    async fn a_held_answer_is_tried_again_as_soon_as_its_question_is_recorded() {
        let (tx, hints) = broadcast::channel(16);
        let (asked, tries) = (Arc::default(), Arc::default());
        let start = Instant::now();
        let held = hold_in_background(hints, &asked, &tries);
        tokio::time::sleep(Duration::from_millis(400)).await;
        // Another run's question: not this answer's.
        tx.send("asked:r2".to_string()).unwrap();
        tokio::task::yield_now().await;
        let before = tries.load(Ordering::SeqCst);
        asked.store(true, Ordering::SeqCst);
        tx.send("asked:r1".to_string()).unwrap();
        assert_eq!(held.await.unwrap(), Ok(()));
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(400),
            "tried at the hint"
        );
        assert_eq!(tries.load(Ordering::SeqCst), before + 1, "one try for it");
    }

    /// A store that may have lost hints (a PostgreSQL listener that lost
    /// its connection) says so once it listens again: a held answer reads
    /// the store then, as for its own hint, instead of at its next pause.
    #[tokio::test(start_paused = true)]
    async fn a_held_answer_is_tried_again_when_the_store_may_have_lost_its_hint() {
        let (tx, hints) = broadcast::channel(16);
        let (asked, tries) = (Arc::default(), Arc::default());
        let start = Instant::now();
        let held = hold_in_background(hints, &asked, &tries);
        tokio::time::sleep(Duration::from_millis(400)).await;
        asked.store(true, Ordering::SeqCst);
        tx.send(REREAD_ALL.to_string()).unwrap();
        assert_eq!(held.await.unwrap(), Ok(()));
        assert_eq!(start.elapsed(), Duration::from_millis(400), "tried at once");
    }

    /// Without hints (a missed one, a closed channel) the answer is tried
    /// on its own schedule, and given up on once the hold passed.
    #[tokio::test(start_paused = true)]
    async fn an_answer_whose_question_never_comes_gives_up_after_the_hold() {
        let (tx, mut hints) = broadcast::channel::<String>(16);
        drop(tx);
        let (asked, tries) = (Arc::default(), Arc::default());
        let mut holds = 0;
        let start = Instant::now();
        let got = hold_for_question(
            &mut hints,
            "asked:r1",
            answer(&asked, &tries),
            |_| true,
            || holds += 1,
        )
        .await;
        assert_eq!(got, Err(NotAsked));
        assert_eq!(
            start.elapsed(),
            EARLY_ANSWER_HOLD,
            "tried last at the hold's end"
        );
        let tries = tries.load(Ordering::SeqCst);
        assert_eq!(holds, tries - 1);
        // At 0, 5, 15, 35, ... 635, 1 275 ms, then every second and at the
        // hold's end: 13 tries, not one per 200 ms (31) or thousands.
        assert_eq!(tries, 13);
    }

    /// Any other error is the answer's result at once.
    #[tokio::test(start_paused = true)]
    async fn an_answer_refused_for_another_reason_is_not_held() {
        let (_tx, mut hints) = broadcast::channel::<String>(16);
        let got: Result<(), &str> = hold_for_question(
            &mut hints,
            "asked:r1",
            || std::future::ready(Err("answered already")),
            |e| *e == "not asked",
            || panic!("held"),
        )
        .await;
        assert_eq!(got, Err("answered already"));
    }
}
