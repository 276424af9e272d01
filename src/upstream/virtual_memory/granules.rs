//! Which granules of a reserved address range are backed by memory: one bit each.

/// A bit set over the granules of one reservation, with the run searches that mapping and
/// trimming need. Searches skip whole words, so a reservation of 80,000 granules (160 GiB
/// in 2 MiB pieces) is scanned in about 1,300 word reads at most.
#[derive(Debug, Clone, Default)]
pub(crate) struct Granules {
    bits: Vec<u64>,
    len: usize,
    mapped: usize,
    /// The most granules mapped at once.
    peak: usize,
}

impl Granules {
    /// `len` granules, none mapped.
    pub(crate) fn new(len: usize) -> Granules {
        Granules {
            bits: vec![0; len.div_ceil(64)],
            len,
            mapped: 0,
            peak: 0,
        }
    }

    /// How many are mapped.
    pub(crate) fn mapped(&self) -> usize {
        self.mapped
    }

    /// The most granules mapped at once so far.
    pub(crate) fn peak(&self) -> usize {
        self.peak
    }

    fn get(&self, i: usize) -> bool {
        self.bits[i / 64] & (1 << (i % 64)) != 0
    }

    /// Whether every granule of `first..first + n` is in range and has the state `mapped`.
    pub(crate) fn all(&self, first: usize, n: usize, mapped: bool) -> bool {
        first.checked_add(n).is_some_and(|end| end <= self.len)
            && (first..first + n).all(|i| self.get(i) == mapped)
    }

    /// Marks `first..first + n` (in range) as mapped or not; returns how many changed.
    pub(crate) fn set(&mut self, first: usize, n: usize, mapped: bool) -> usize {
        let mut changed = 0;
        for i in first..first + n {
            if self.get(i) != mapped {
                self.bits[i / 64] ^= 1 << (i % 64);
                changed += 1;
            }
        }
        if mapped {
            self.mapped += changed;
            self.peak = self.peak.max(self.mapped);
        } else {
            self.mapped -= changed;
        }
        changed
    }

    /// The first granule of the lowest run of `n` unmapped granules (`n >= 1`).
    pub(crate) fn find_unmapped(&self, n: usize) -> Option<usize> {
        let mut start = 0;
        let mut i = 0;
        while i < self.len {
            if i % 64 == 0 && self.bits[i / 64] == u64::MAX {
                i += 64;
                start = i;
                continue;
            }
            if self.get(i) {
                start = i + 1;
            } else if i + 1 - start >= n {
                return Some(start);
            }
            i += 1;
        }
        None
    }

    /// One past the highest mapped granule (0 when none is mapped).
    pub(crate) fn top(&self) -> usize {
        self.bits
            .iter()
            .rposition(|&w| w != 0)
            .map_or(0, |w| w * 64 + 64 - self.bits[w].leading_zeros() as usize)
    }

    /// The runs of mapped granules, lowest first, as `(first, n)`.
    pub(crate) fn mapped_runs(&self) -> Vec<(usize, usize)> {
        self.runs(true)
    }

    /// The runs of unmapped granules, lowest first, as `(first, n)` (the last one reaches
    /// the end of the range).
    pub(crate) fn unmapped_runs(&self) -> Vec<(usize, usize)> {
        self.runs(false)
    }

    fn runs(&self, mapped: bool) -> Vec<(usize, usize)> {
        // A word with no granule in the wanted state is skipped whole.
        let skip = if mapped { 0 } else { u64::MAX };
        let mut runs = Vec::new();
        let mut i = 0;
        while i < self.len {
            if i % 64 == 0 && self.bits[i / 64] == skip {
                i += 64;
                continue;
            }
            if self.get(i) == mapped {
                let first = i;
                while i < self.len && self.get(i) == mapped {
                    i += 1;
                }
                runs.push((first, i - first));
            } else {
                i += 1;
            }
        }
        runs
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
}
