//! Which granules of a reserved address range are backed by memory.

use std::collections::BTreeMap;

/// The mapped granules of one reservation, as their runs: first granule -> length, the
/// runs disjoint and never touching (neighbours merge). Every search and change costs in
/// the number of runs (logarithmic where it can), not in the size of the reservation: a
/// 1 TiB reservation of 4 KiB granules (268 M granules) grows as fast as one of 16 K.
#[derive(Debug, Clone, Default)]
pub(crate) struct Granules {
    runs: BTreeMap<usize, usize>,
    len: usize,
    mapped: usize,
    /// Granules taken by [`claim`](Self::claim) and not yet committed or given up: in
    /// `runs` (no search finds them unmapped), not in `mapped`.
    claimed: usize,
    /// The most granules mapped at once.
    peak: usize,
}

impl Granules {
    /// `len` granules, none mapped.
    pub(crate) fn new(len: usize) -> Granules {
        Granules {
            runs: BTreeMap::new(),
            len,
            mapped: 0,
            claimed: 0,
            peak: 0,
        }
    }

    /// How many are claimed ([`claim`](Self::claim)) and not yet committed or given up.
    pub(crate) fn claimed(&self) -> usize {
        self.claimed
    }

    /// Takes `first..first + n` (in range, unmapped) for a map made outside the lock:
    /// every search sees it mapped, but it counts as mapped (and in the peak) only once
    /// [`commit`](Self::commit)ted; [`unclaim`](Self::unclaim) gives it up.
    pub(crate) fn claim(&mut self, first: usize, n: usize) {
        self.claimed += self.set_runs(first, n, true);
    }

    /// Counts `n` claimed granules (their map succeeded) as mapped.
    pub(crate) fn commit(&mut self, n: usize) {
        let n = n.min(self.claimed);
        self.claimed -= n;
        self.mapped += n;
        self.peak = self.peak.max(self.mapped);
    }

    /// Gives up the claim on `first..first + n` (its map failed): unmapped again.
    pub(crate) fn unclaim(&mut self, first: usize, n: usize) {
        self.claimed -= self.set_runs(first, n, false);
    }

    /// How many are mapped.
    pub(crate) fn mapped(&self) -> usize {
        self.mapped
    }

    /// The most granules mapped at once so far.
    pub(crate) fn peak(&self) -> usize {
        self.peak
    }

    /// The runs that overlap `first..end` (as `(first, n)`, lowest first).
    fn overlapping(&self, first: usize, end: usize) -> Vec<(usize, usize)> {
        let before = self
            .runs
            .range(..first)
            .next_back()
            .filter(|&(&s, &n)| s + n > first)
            .map(|(&s, &n)| (s, n));
        before
            .into_iter()
            .chain(self.runs.range(first..end).map(|(&s, &n)| (s, n)))
            .collect()
    }

    /// Whether every granule of `first..first + n` is in range and has the state `mapped`.
    pub(crate) fn all(&self, first: usize, n: usize, mapped: bool) -> bool {
        let Some(end) = first.checked_add(n).filter(|&end| end <= self.len) else {
            return false;
        };
        if n == 0 {
            return true;
        }
        let over = self.overlapping(first, end);
        if mapped {
            // One run covers the whole range.
            over.len() == 1 && over[0].0 <= first && over[0].0 + over[0].1 >= end
        } else {
            over.is_empty()
        }
    }

    /// Marks `first..first + n` (in range) as mapped or not; returns how many changed.
    pub(crate) fn set(&mut self, first: usize, n: usize, mapped: bool) -> usize {
        let changed = self.set_runs(first, n, mapped);
        if mapped {
            self.mapped += changed;
            self.peak = self.peak.max(self.mapped);
        } else {
            self.mapped -= changed;
        }
        changed
    }

    /// [`set`](Self::set)'s change of the runs alone (no count changes).
    fn set_runs(&mut self, first: usize, n: usize, mapped: bool) -> usize {
        let end = first + n;
        if n == 0 {
            return 0;
        }
        // Runs that overlap the range, and (when mapping) those that touch it.
        let (lo, hi) = if mapped {
            (first.saturating_sub(1), end + 1)
        } else {
            (first, end)
        };
        let around = self.overlapping(lo, hi);
        let covered: usize = around
            .iter()
            .map(|&(s, len)| (s + len).min(end).saturating_sub(s.max(first)))
            .sum();
        for &(s, _) in &around {
            self.runs.remove(&s);
        }
        if mapped {
            let start = around.first().map_or(first, |&(s, _)| s.min(first));
            let stop = around.last().map_or(end, |&(s, len)| (s + len).max(end));
            self.runs.insert(start, stop - start);
            n - covered
        } else {
            for (s, len) in around {
                if s < first {
                    self.runs.insert(s, first - s);
                }
                if s + len > end {
                    self.runs.insert(end, s + len - end);
                }
            }
            covered
        }
    }

    /// The first granule of the lowest run of `n` unmapped granules (`n >= 1`).
    pub(crate) fn find_unmapped(&self, n: usize) -> Option<usize> {
        self.unmapped_runs()
            .into_iter()
            .find(|&(_, len)| len >= n)
            .map(|(first, _)| first)
    }

    /// One past the highest mapped granule (0 when none is mapped).
    pub(crate) fn top(&self) -> usize {
        self.runs.iter().next_back().map_or(0, |(&s, &n)| s + n)
    }

    /// The runs of mapped granules, lowest first, as `(first, n)`.
    pub(crate) fn mapped_runs(&self) -> Vec<(usize, usize)> {
        self.runs.iter().map(|(&s, &n)| (s, n)).collect()
    }

    /// The runs of unmapped granules, lowest first, as `(first, n)` (the last one reaches
    /// the end of the range).
    pub(crate) fn unmapped_runs(&self) -> Vec<(usize, usize)> {
        let mut gaps = Vec::with_capacity(self.runs.len() + 1);
        let mut at = 0;
        for (&s, &n) in &self.runs {
            if s > at {
                gaps.push((at, s - at));
            }
            at = s + n;
        }
        if at < self.len {
            gaps.push((at, self.len - at));
        }
        gaps
    }
}

#[cfg(test)]
mod tests {
    use super::Granules;

    #[test]
    fn runs_are_found_and_counted() {
        let mut g = Granules::new(200);
        assert_eq!(g.find_unmapped(200), Some(0));
        assert_eq!(g.find_unmapped(201), None);
        assert_eq!(g.set(0, 130, true), 130);
        assert_eq!(g.set(10, 5, true), 0, "already mapped");
        assert_eq!(g.mapped(), 130);
        assert_eq!(g.top(), 130);
        assert_eq!(g.set(60, 10, false), 10);
        assert_eq!(g.find_unmapped(10), Some(60));
        assert_eq!(g.find_unmapped(11), Some(130));
        assert!(g.all(60, 10, false) && g.all(0, 60, true) && !g.all(55, 10, true));
        assert!(!g.all(190, 20, false), "past the end");
        assert_eq!(g.mapped_runs(), vec![(0, 60), (70, 60)]);
        assert_eq!(g.unmapped_runs(), vec![(60, 10), (130, 70)]);
        g.set(0, 200, false);
        assert_eq!((g.mapped(), g.top(), g.peak()), (0, 0, 130));
        assert!(g.mapped_runs().is_empty());
        assert_eq!(g.unmapped_runs(), vec![(0, 200)]);
    }

    #[test]
    fn a_claim_is_taken_at_once_but_counts_as_mapped_only_once_committed() {
        let mut g = Granules::new(100);
        g.set(0, 10, true);
        g.claim(10, 20);
        assert_eq!((g.mapped(), g.claimed(), g.peak()), (10, 20, 10));
        assert!(g.all(10, 20, true), "searches see it taken");
        assert_eq!(g.find_unmapped(1), Some(30));
        g.claim(40, 5);
        g.unclaim(40, 5);
        assert_eq!(
            (g.mapped(), g.claimed(), g.peak()),
            (10, 20, 10),
            "a failed map"
        );
        assert!(g.all(40, 5, false));
        g.commit(20);
        assert_eq!((g.mapped(), g.claimed(), g.peak()), (30, 0, 30));
        assert_eq!(g.mapped_runs(), vec![(0, 30)]);
    }

    /// Random changes against a plain vector of flags: the same counts, runs and answers.
    #[test]
    fn runs_agree_with_a_vector_of_flags() {
        let mut state = 7u64;
        let mut next = |m: usize| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as usize % m
        };
        let len = 300;
        let mut g = Granules::new(len);
        let mut flags = vec![false; len];
        for _ in 0..5_000 {
            let first = next(len);
            let n = next(len - first + 1);
            let mapped = next(2) == 0;
            let changed = (first..first + n).filter(|&i| flags[i] != mapped).count();
            flags[first..first + n].iter_mut().for_each(|f| *f = mapped);
            assert_eq!(g.set(first, n, mapped), changed);
            assert_eq!(g.mapped(), flags.iter().filter(|&&f| f).count());
            let (a, k) = (next(len), next(8));
            let want = a + k <= len && flags[a..a + k].iter().all(|&f| f == mapped);
            assert_eq!(g.all(a, k, mapped), want, "all({a}, {k}, {mapped})");
            let k = 1 + next(20);
            let want = (0..=len.saturating_sub(k)).find(|&i| flags[i..i + k].iter().all(|&f| !f));
            assert_eq!(g.find_unmapped(k), want);
            let top = flags.iter().rposition(|&f| f).map_or(0, |i| i + 1);
            assert_eq!(g.top(), top);
        }
        let runs = |want: bool| {
            let mut out = Vec::new();
            let mut i = 0;
            while i < len {
                if flags[i] == want {
                    let s = i;
                    while i < len && flags[i] == want {
                        i += 1;
                    }
                    out.push((s, i - s));
                } else {
                    i += 1;
                }
            }
            out
        };
        assert_eq!(g.mapped_runs(), runs(true));
        assert_eq!(g.unmapped_runs(), runs(false));
    }
}
