//! One way to take a std `Mutex` or `RwLock` everywhere.
//!
//! A panic inside a run is contained to that run (`agent::contain`), but a
//! std lock held at that moment stays poisoned, and every later `lock()
//! .unwrap()` on it would panic too. For state shared across runs (a hook's
//! breaker, connection pool or schema cache) that would turn one run's panic
//! into every later run's failure. The state behind these locks is updated
//! in single steps, so the data a panicking holder leaves is still
//! consistent: taking the lock anyway is the right recovery.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub trait LockExt<T: ?Sized> {
    /// The guard, whether or not an earlier holder panicked.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub trait RwLockExt<T: ?Sized> {
    /// A read guard, whether or not an earlier writer panicked.
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    /// The write guard, whether or not an earlier writer panicked.
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_whose_holder_panicked_is_still_taken() {
        let m = std::sync::Arc::new(Mutex::new(vec![1]));
        let held = m.clone();
        let r = std::thread::spawn(move || {
            let mut g = held.lock().unwrap();
            g.push(2);
            panic!("holder panics");
        })
        .join();
        assert!(r.is_err());
        assert!(m.is_poisoned());
        assert_eq!(*m.locked(), vec![1, 2]);
    }

    #[test]
    fn a_rwlock_whose_writer_panicked_is_still_read_and_written() {
        let l = std::sync::Arc::new(RwLock::new(1));
        let held = l.clone();
        let r = std::thread::spawn(move || {
            let mut g = held.write().unwrap();
            *g = 2;
            panic!("writer panics");
        })
        .join();
        assert!(r.is_err());
        assert!(l.is_poisoned());
        assert_eq!(*l.read_locked(), 2);
        *l.write_locked() = 3;
        assert_eq!(*l.read_locked(), 3);
    }
}
