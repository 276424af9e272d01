//! [`Router`]: one resource over N members, each allocation sent to the member a rule
//! picks, each free to the member that served the block (told by its address).

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use super::owners::Owners;
use crate::error::Error;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;
use crate::sync::{AppendOnly, Mutex, lock};

/// How a [`Router`] routes allocations: the member each goes to, and how a member is
/// made the first time its key is asked for.
pub trait Route {
    /// The members' resource type.
    type Member;

    /// The key of the member the allocation of `layout` goes to, or `None` for the
    /// router's default member. Called on every allocation through the router's
    /// [`Resource`] impl: keep it cheap (a load).
    fn choose(&self, layout: Layout) -> Option<usize>;

    /// Makes the member of `key` (called once per key, under the router's lock for
    /// making members, so what it reads there is ordered with
    /// [`Router::update`]).
    ///
    /// # Errors
    /// The error of making the member, which the allocation that asked for it returns.
    fn make(&self, key: usize) -> Result<Member<Self::Member>, Error>;
}

/// A member resource of a [`Router`], with how its blocks are told apart from other
/// members': an address range that holds them all, or a record of each.
pub struct Member<M> {
    resource: M,
    range: Option<(usize, usize)>,
}

impl<M> Member<M> {
    /// A member whose blocks all lie in `base..base + len` (a virtual pool's reservation,
    /// [`GrowInPlace::reservation`]): a free there goes to it with no record kept.
    ///
    /// # Safety
    /// Every block `resource` hands out lies in the range, and no block of the router's
    /// other members (the default one included) ever does.
    ///
    /// [`GrowInPlace::reservation`]: crate::upstream::GrowInPlace::reservation
    pub unsafe fn in_range(resource: M, base: usize, len: usize) -> Member<M> {
        Member {
            resource,
            range: Some((base, len)),
        }
    }

    /// A member whose blocks may lie anywhere: the router records the start of each it
    /// hands out (under a lock) and its free takes the record.
    pub fn recorded(resource: M) -> Member<M> {
        Member {
            resource,
            range: None,
        }
    }

    /// The member's resource.
    pub fn resource(&self) -> &M {
        &self.resource
    }

    /// The range that holds its blocks, if it has one.
    pub fn range(&self) -> Option<(usize, usize)> {
        self.range
    }
}

/// A member in the router's list: its key and whether its blocks are recorded.
struct Keyed<M> {
    key: usize,
    member: Member<M>,
}

/// One resource over a default member and N keyed members: an allocation goes to the
/// member its [`Route`] picks (made by the route on its key's first use) or to the one
/// the caller names ([`allocate_in`](Self::allocate_in)); a free goes to the member
/// that served the block, found by its address. This is `Fallback`'s dispatch for N
/// members chosen by a rule: the C ABI's tagged pools (`memres_set_tag`) are a router
/// whose default member is the base of the device's stack (under its `statistics(..)`,
/// `limiting(..)` and `logging(..)`, which so see every block) and whose members are the
/// tags' pools.
///
/// - **Which member freed**: the one whose range holds the address ([`Member::in_range`]:
///   a pool over a reservation of its own; a lock-free look at each range), else the one
///   that recorded the block's start ([`Member::recorded`]: a lock while any block is
///   recorded), else the default member. A free costs one load while no member exists.
/// - **Blocks used on other streams**: [`deallocate_used_on`](Resource::deallocate_used_on)
///   goes to the member that served the block with its streams, so a stream-ordered pool
///   holds it there (the router adds no waiting of its own).
/// - **Empty requests** (zero bytes) are the default member's, whatever the route says:
///   their dangling pointers lie in no member's range and may repeat.
/// - **Members** are never removed while the router lives: [`member`](Self::member) and
///   [`holding`](Self::holding) hand out plain references. Properties are the default
///   member's; every member has the same.
/// - **Equality**: a router equals only itself.
///
/// ```
/// use std::alloc::Layout;
/// use memres::adaptor::{Limiting, Member, Route, Router};
/// use memres::{Error, HostHeap, SyncResource, layout};
///
/// /// Requests of 1 MiB and more go to member 1, made on first use.
/// struct BySize;
/// impl Route for BySize {
///     type Member = Limiting<HostHeap>;
///     fn choose(&self, layout: Layout) -> Option<usize> {
///         (layout.size() >= 1 << 20).then_some(1)
///     }
///     fn make(&self, _key: usize) -> Result<Member<Limiting<HostHeap>>, Error> {
///         Ok(Member::recorded(Limiting::new(HostHeap::new(), 64 << 20)))
///     }
/// }
///
/// let router = Router::new(Limiting::new(HostHeap::new(), 1 << 30), BySize);
/// let (small, large) = (layout(4096)?, layout(2 << 20)?);
/// let a = router.allocate_sync(small)?;
/// let b = router.allocate_sync(large)?;
/// assert_eq!(router.find(1).map(|m| m.allocated_bytes()), Some(2 << 20));
/// assert_eq!(router.default_member().allocated_bytes(), 4096);
/// // SAFETY: each allocated above with its layout, not used afterwards.
/// unsafe {
///     router.deallocate_sync(b, large); // back to member 1, by its record
///     router.deallocate_sync(a, small);
/// }
/// assert_eq!(router.find(1).map(|m| m.allocated_bytes()), Some(0));
/// # Ok::<(), Error>(())
/// ```
pub struct Router<D, M, R> {
    default: D,
    route: R,
    members: AppendOnly<Keyed<M>>,
    /// Which member (its index in `members`) holds an address.
    owners: Owners,
    /// Held while a member is made or added, and by [`update`](Self::update).
    making: Mutex<()>,
}

impl<D, M, R> Router<D, M, R> {
    /// A router with no keyed member yet: what the route picks no member for, and every
    /// free of a block no member served, goes to `default`.
    pub fn new(default: D, route: R) -> Self {
        Router {
            default,
            route,
            members: AppendOnly::default(),
            owners: Owners::default(),
            making: Mutex::new(()),
        }
    }

    /// The default member.
    pub fn default_member(&self) -> &D {
        &self.default
    }

    /// The route.
    pub fn route(&self) -> &R {
        &self.route
    }

    /// The member of `key`, if the router has one.
    pub fn find(&self, key: usize) -> Option<&M> {
        self.index_of(key)
            .and_then(|i| self.members.get(i))
            .map(|k| &k.member.resource)
    }

    fn index_of(&self, key: usize) -> Option<usize> {
        self.members.iter().position(|k| k.key == key)
    }

    /// The member holding `address`: the one whose range holds it, or the one a live
    /// block starting there was recorded for; `None` for the default member's memory (or
    /// memory the router never handed out).
    pub fn holding(&self, address: usize) -> Option<&M> {
        let index = self.owners.owner(address)?;
        self.members.get(index).map(|k| &k.member.resource)
    }

    /// Every keyed member with its key, in the order they joined.
    pub fn members(&self) -> impl Iterator<Item = (usize, &M)> {
        self.members.iter().map(|k| (k.key, &k.member.resource))
    }

    /// Every range a member's blocks lie in, as `(base, len, key)`.
    pub fn ranges(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.owners
            .ranges()
            .filter_map(|(base, len, index)| self.members.get(index).map(|k| (base, len, k.key)))
    }

    /// Adds `member` under `key`, as the route would have made it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the router already has a member of `key`.
    pub fn add(&self, key: usize, member: Member<M>) -> Result<&M, Error> {
        let _making = lock(&self.making);
        if self.index_of(key).is_some() {
            return Err(Error::invalid_argument(format!(
                "Router::add: the router already has a member of key {key}"
            )));
        }
        Ok(self.join(key, member).1)
    }

    /// Lists `member` (the caller holds `making`) and returns its index: its range
    /// first, so that no block of it is handed out (which needs the member listed) before
    /// a free can find it.
    fn join(&self, key: usize, member: Member<M>) -> (usize, &M) {
        if let Some((base, len)) = member.range {
            // The index the push below gives: pushes happen under `making` only.
            self.owners.add_range(base, len, self.members.len());
        }
        let (index, keyed) = self.members.push(Keyed { key, member });
        (index, &keyed.member.resource)
    }

    /// The member (its index) that served the `layout` block at `ptr`, which the caller is
    /// freeing; `None` for the default member.
    #[inline]
    fn owner_of_freed(&self, ptr: NonNull<u8>, layout: Layout) -> Option<&M> {
        if layout.size() == 0 {
            return None;
        }
        let index = self.owners.take(ptr.as_ptr().addr())?;
        self.members.get(index).map(|k| &k.member.resource)
    }
}

impl<D, M, R: Route<Member = M>> Router<D, M, R> {
    /// The member of `key`, made by the route on its first use (one member per key: a
    /// thread that finds none looks again under the lock before making it).
    ///
    /// # Errors
    /// The route's error making the member.
    pub fn member(&self, key: usize) -> Result<&M, Error> {
        self.keyed(key).map(|(m, _)| m)
    }

    /// The member of `key` (made if needed), with its index when its blocks are recorded.
    fn keyed(&self, key: usize) -> Result<(&M, Option<usize>), Error> {
        let found = self
            .index_of(key)
            .and_then(|i| self.members.get(i).map(|k| (i, k)));
        if let Some((index, k)) = found {
            return Ok((
                &k.member.resource,
                k.member.range.is_none().then_some(index),
            ));
        }
        let _making = lock(&self.making);
        if let Some(index) = self.index_of(key)
            && let Some(k) = self.members.get(index)
        {
            // Made by another thread while this one waited.
            return Ok((
                &k.member.resource,
                k.member.range.is_none().then_some(index),
            ));
        }
        let member = self.route.make(key)?;
        let recorded = member.range.is_none();
        let (index, m) = self.join(key, member);
        Ok((m, recorded.then_some(index)))
    }

    /// Runs `route` on the route, then `each` on every member, while no member is made:
    /// a member made beside this call is either made first (and `each` sees it) or after
    /// (and its [`Route::make`] sees what `route` changed). The C ABI bounds its tags'
    /// pools this way, those made later too.
    pub fn update(&self, route: impl FnOnce(&R), mut each: impl FnMut(&M)) {
        let _making = lock(&self.making);
        route(&self.route);
        for keyed in self.members.iter() {
            each(&keyed.member.resource);
        }
    }

    /// The member an allocation of `layout` goes to (`None`: the default), with its index
    /// when its blocks are recorded.
    #[inline]
    fn chosen(&self, layout: Layout) -> Result<Option<(&M, Option<usize>)>, Error> {
        if layout.size() == 0 {
            return Ok(None);
        }
        match self.route.choose(layout) {
            None => Ok(None),
            Some(key) => self.keyed(key).map(Some),
        }
    }

    /// Records a block a member without a range served.
    #[inline]
    fn served(&self, p: NonNull<u8>, recorded: Option<usize>) -> NonNull<u8> {
        if let Some(index) = recorded {
            self.owners.record(p.as_ptr().expose_provenance(), index);
        }
        p
    }
}

impl<D, M, R> Router<D, M, R>
where
    D: Resource,
    M: Resource<Properties = D::Properties>,
    R: Route<Member = M>,
{
    /// Allocates from the member of `key` (made by the route on first use), or from the
    /// default member for `None`, whatever the route would choose.
    ///
    /// # Errors
    /// The member's error, or the route's error making it.
    pub fn allocate_in(
        &self,
        key: Option<usize>,
        stream: StreamRef<'_>,
        layout: Layout,
    ) -> Result<NonNull<u8>, Error> {
        match key {
            Some(key) if layout.size() > 0 => {
                let (m, recorded) = self.keyed(key)?;
                Ok(self.served(m.allocate(stream, layout)?, recorded))
            }
            _ => self.default.allocate(stream, layout),
        }
    }
}

impl<D, M, R> PartialEq for Router<D, M, R> {
    /// Equal only to itself: its records and members are its own.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl<D: fmt::Debug, M: fmt::Debug, R> fmt::Debug for Router<D, M, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Router")
            .field("default", &self.default)
            .field("members", &self.members().collect::<Vec<_>>())
            .field("recorded_blocks", &self.owners.recorded())
            .finish_non_exhaustive()
    }
}

// SAFETY: every block comes from one member unchanged and goes back to it: a keyed
// member's block lies in its range (`Member::in_range`'s contract) or is recorded before
// it is handed out and its record taken by its free; the default member's lie in no
// member's range and are never recorded; empty blocks are all the default's. Every
// member has the default member's properties.
unsafe impl<D, M, R> SyncResource for Router<D, M, R>
where
    D: SyncResource,
    M: SyncResource<Properties = D::Properties>,
    R: Route<Member = M> + Send + Sync,
{
    type Properties = D::Properties;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.chosen(layout)? {
            None => self.default.allocate_sync(layout),
            Some((m, recorded)) => Ok(self.served(m.allocate_sync(layout)?, recorded)),
        }
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the member that served the block.
        unsafe {
            match self.owner_of_freed(ptr, layout) {
                Some(m) => m.deallocate_sync(ptr, layout),
                None => self.default.deallocate_sync(ptr, layout),
            }
        }
    }
}

// SAFETY: as for `SyncResource`; a free keeps its stream (and the streams that used the
// block) in the member it goes to.
unsafe impl<D, M, R> Resource for Router<D, M, R>
where
    D: Resource,
    M: Resource<Properties = D::Properties>,
    R: Route<Member = M> + Send + Sync,
{
    #[inline]
    fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        match self.chosen(layout)? {
            None => self.default.allocate(stream, layout),
            Some((m, recorded)) => Ok(self.served(m.allocate(stream, layout)?, recorded)),
        }
    }

    #[inline]
    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's promise, for the member that served the block.
        unsafe {
            match self.owner_of_freed(ptr, layout) {
                Some(m) => m.deallocate(stream, ptr, layout),
                None => self.default.deallocate(stream, ptr, layout),
            }
        }
    }

    #[inline]
    unsafe fn deallocate_used_on(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        layout: Layout,
        used_on: &[StreamRef<'_>],
    ) {
        // SAFETY: the caller's promise, for the member that served the block.
        unsafe {
            match self.owner_of_freed(ptr, layout) {
                Some(m) => m.deallocate_used_on(stream, ptr, layout, used_on),
                None => self
                    .default
                    .deallocate_used_on(stream, ptr, layout, used_on),
            }
        }
    }
}

#[cfg(all(test, not(memres_loom)))]
mod tests {
    use std::sync::Mutex as StdMutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::adaptor::Limiting;
    use crate::property::Host;
    use crate::resource::layout;
    use crate::upstream::{GrowInPlace, HostHeap, HostVirtual};
    use crate::{VirtualPool, VirtualPoolConfig};

    /// The heap, counting its frees and the streams each stream-ordered free named.
    #[derive(Default)]
    struct Counted {
        heap: HostHeap,
        frees: AtomicUsize,
        used_on: StdMutex<Vec<usize>>,
    }

    impl PartialEq for Counted {
        fn eq(&self, other: &Self) -> bool {
            std::ptr::eq(self, other)
        }
    }

    impl PartialEq for Either {
        fn eq(&self, other: &Self) -> bool {
            std::ptr::eq(self, other)
        }
    }

    // SAFETY: the heap's blocks, unchanged.
    unsafe impl SyncResource for Counted {
        type Properties = Host;

        fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
            self.heap.allocate_sync(layout)
        }

        unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
            self.frees.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the caller's promise; the heap served the block.
            unsafe { self.heap.deallocate_sync(ptr, layout) }
        }
    }

    // SAFETY: as above; host memory needs no stream order.
    unsafe impl Resource for Counted {
        fn allocate(&self, _: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
            self.allocate_sync(layout)
        }

        unsafe fn deallocate(&self, _: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
            // SAFETY: the caller's promise.
            unsafe { self.deallocate_sync(ptr, layout) }
        }

        unsafe fn deallocate_used_on(
            &self,
            _: StreamRef<'_>,
            ptr: NonNull<u8>,
            layout: Layout,
            used_on: &[StreamRef<'_>],
        ) {
            self.used_on.lock().unwrap().push(used_on.len());
            // SAFETY: the caller's promise.
            unsafe { self.deallocate_sync(ptr, layout) }
        }
    }

    /// A member: a virtual pool over host memory (a range), or the counted heap (records).
    enum Either {
        Pool(Box<VirtualPool<HostVirtual>>),
        Heap(Counted),
    }

    // SAFETY: each variant's blocks, unchanged, back to the same variant.
    unsafe impl SyncResource for Either {
        type Properties = Host;

        fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
            self.allocate(StreamRef::HOST, layout)
        }

        unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
            // SAFETY: the caller's promise.
            unsafe { self.deallocate(StreamRef::HOST, ptr, layout) }
        }
    }

    // SAFETY: as above.
    unsafe impl Resource for Either {
        fn allocate(&self, stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
            match self {
                Either::Pool(p) => p.allocate(stream, layout),
                Either::Heap(h) => h.allocate(stream, layout),
            }
        }

        unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
            // SAFETY: the caller's promise, for the variant that served the block.
            unsafe { self.deallocate_used_on(stream, ptr, layout, &[]) }
        }

        unsafe fn deallocate_used_on(
            &self,
            stream: StreamRef<'_>,
            ptr: NonNull<u8>,
            layout: Layout,
            used_on: &[StreamRef<'_>],
        ) {
            // SAFETY: the caller's promise, for the variant that served the block.
            unsafe {
                match self {
                    Either::Pool(p) => p.deallocate_used_on(stream, ptr, layout, used_on),
                    Either::Heap(h) => h.deallocate_used_on(stream, ptr, layout, used_on),
                }
            }
        }
    }

    /// Keys 1 and 2 are virtual pools (ranges), 3 the counted heap (records); the key
    /// chosen is the one set in `now` (0: the default).
    #[derive(Default)]
    struct ByKey {
        now: AtomicUsize,
        made: AtomicUsize,
    }

    impl Route for ByKey {
        type Member = Either;

        fn choose(&self, _: Layout) -> Option<usize> {
            match self.now.load(Ordering::Relaxed) {
                0 => None,
                key => Some(key),
            }
        }

        fn make(&self, key: usize) -> Result<Member<Either>, Error> {
            self.made.fetch_add(1, Ordering::Relaxed);
            match key {
                1 | 2 => {
                    let pool = VirtualPool::new(
                        HostVirtual::with_limit(1 << 30, 64 << 10, 8 << 20)?,
                        VirtualPoolConfig::new(),
                    )?;
                    let (base, len) = pool.upstream().reservation();
                    // SAFETY: the pool's blocks lie in its reservation, which is its own.
                    Ok(unsafe { Member::in_range(Either::Pool(Box::new(pool)), base, len) })
                }
                3 => Ok(Member::recorded(Either::Heap(Counted::default()))),
                _ => Err(Error::invalid_argument("no such member")),
            }
        }
    }

    fn router() -> Router<Limiting<Counted>, Either, ByKey> {
        Router::new(Limiting::new(Counted::default(), 1 << 30), ByKey::default())
    }

    fn live(m: &Either) -> usize {
        match m {
            Either::Pool(p) => p.stats().live_bytes(),
            Either::Heap(h) => h.frees.load(Ordering::Relaxed),
        }
    }

    /// Allocations go where the route says (members made once, on first use); every free,
    /// in any order and on any stream, reaches the member that served the block, by its
    /// range or its record, and the default member's blocks stay the default's.
    #[test]
    fn frees_reach_the_member_that_served_the_block() {
        let r = router();
        let l = layout(64 << 10).unwrap();
        let mut blocks = Vec::new();
        for round in 0..3 {
            for key in [0, 1, 2, 3] {
                r.route().now.store(key, Ordering::Relaxed);
                let p = r.allocate(StreamRef::host(round), l).unwrap();
                blocks.push((p, key));
            }
        }
        assert_eq!(r.route().made.load(Ordering::Relaxed), 3, "made once each");
        assert_eq!(r.members().map(|(k, _)| k).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(r.default_member().allocated_bytes(), 3 * (64 << 10));
        assert_eq!(r.ranges().count(), 2, "the pools' reservations");
        for &(p, key) in &blocks {
            let held_by = r.holding(p.as_ptr().addr()).map(|m| m as *const Either);
            let expected = (key != 0).then(|| r.find(key).unwrap() as *const Either);
            assert_eq!(held_by, expected, "block of member {key}");
        }
        assert!(r.holding(0x1000).is_none());
        blocks.reverse();
        blocks.rotate_left(5);
        for (p, _) in blocks {
            // SAFETY: allocated above with `l`, not used; host streams.
            unsafe { r.deallocate(StreamRef::host(7), p, l) };
        }
        assert_eq!(r.default_member().allocated_bytes(), 0);
        assert_eq!(live(r.find(1).unwrap()), 0);
        assert_eq!(live(r.find(2).unwrap()), 0);
        assert_eq!(live(r.find(3).unwrap()), 3, "the heap's three frees");
        assert_eq!(r.owners.recorded(), 0, "every record taken");
    }

    /// A free with the streams that used the block hands them to the member that served
    /// it, recorded or ranged, and to the default member for its own blocks.
    #[test]
    fn deallocate_used_on_reaches_the_member_with_its_streams() {
        let r = router();
        let l = layout(4096).unwrap();
        r.route().now.store(3, Ordering::Relaxed);
        let recorded = r.allocate(StreamRef::HOST, l).unwrap();
        r.route().now.store(1, Ordering::Relaxed);
        let ranged = r.allocate(StreamRef::HOST, l).unwrap();
        r.route().now.store(0, Ordering::Relaxed);
        let default = r.allocate(StreamRef::HOST, l).unwrap();
        let used_on = [StreamRef::host(1), StreamRef::host(2)];
        // SAFETY: each allocated above with `l`, not used; host streams live.
        unsafe {
            r.deallocate_used_on(StreamRef::HOST, recorded, l, &used_on);
            r.deallocate_used_on(StreamRef::HOST, ranged, l, &used_on);
            r.deallocate_used_on(StreamRef::HOST, default, l, &used_on[..1]);
        }
        let Some(Either::Heap(heap)) = r.find(3) else {
            panic!("member 3 is the heap")
        };
        assert_eq!(*heap.used_on.lock().unwrap(), [2]);
        assert_eq!(*r.default_member().upstream().used_on.lock().unwrap(), [1]);
        assert_eq!(live(r.find(1).unwrap()), 0, "the pool took its block back");
    }

    /// Empty requests are the default member's whatever the route says; a key the
    /// route cannot make is its error, with nothing added; `add` refuses a key in use;
    /// `allocate_in` goes to the member named; `update` reaches every member.
    #[test]
    fn empty_requests_errors_and_members_named_by_the_caller() {
        let r = router();
        r.route().now.store(3, Ordering::Relaxed);
        let empty = Layout::from_size_align(0, 64).unwrap();
        let z = r.allocate_sync(empty).unwrap();
        assert_eq!(
            r.members().count(),
            0,
            "no member made for an empty request"
        );
        // SAFETY: allocated above with `empty`.
        unsafe { r.deallocate_sync(z, empty) };
        r.route().now.store(9, Ordering::Relaxed);
        let l = layout(4096).unwrap();
        assert!(matches!(r.allocate_sync(l), Err(Error::InvalidArgument(_))));
        assert_eq!(r.members().count(), 0);
        let added = r.add(5, Member::recorded(Either::Heap(Counted::default())));
        assert!(added.is_ok());
        assert!(matches!(
            r.add(5, Member::recorded(Either::Heap(Counted::default()))),
            Err(Error::InvalidArgument(_))
        ));
        let p = r.allocate_in(Some(5), StreamRef::HOST, l).unwrap();
        assert!(std::ptr::eq(
            r.holding(p.as_ptr().addr()).unwrap(),
            r.find(5).unwrap()
        ));
        let d = r.allocate_in(None, StreamRef::HOST, l).unwrap();
        assert_eq!(r.default_member().allocated_bytes(), 4096);
        // SAFETY: allocated above with `l`.
        unsafe {
            r.deallocate_sync(p, l);
            r.deallocate_sync(d, l);
        }
        assert_eq!(live(r.find(5).unwrap()), 1);
        let mut seen = 0;
        r.update(|route| route.now.store(0, Ordering::Relaxed), |_| seen += 1);
        assert_eq!((seen, r.route().choose(l)), (1, None));
    }
}

#[cfg(all(test, memres_loom))]
mod loom_models {

    use super::*;
    use crate::sync::Arc;
    use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use loom::thread;

    /// Makes stand-in members (a member's real resource needs no GPU here: the router
    /// never calls it in these models) at `0x1000 * key`, counting the members made,
    /// each reading the bound `update` sets.
    #[derive(Default)]
    struct StandIns {
        made: AtomicUsize,
        bound: AtomicUsize,
    }

    /// A stand-in member: its key and the bound it was made or updated with.
    struct StandIn {
        key: usize,
        bound: std::sync::Mutex<usize>,
    }

    impl Route for StandIns {
        type Member = StandIn;

        fn choose(&self, _: Layout) -> Option<usize> {
            None
        }

        fn make(&self, key: usize) -> Result<Member<StandIn>, Error> {
            self.made.fetch_add(1, Ordering::Relaxed);
            let member = StandIn {
                key,
                bound: std::sync::Mutex::new(self.bound.load(Ordering::Relaxed)),
            };
            // SAFETY: no block is allocated in these models.
            Ok(unsafe { Member::in_range(member, 0x1000 * key, 0x1000) })
        }
    }

    fn router() -> Arc<Router<(), StandIn, StandIns>> {
        Arc::new(Router::new((), StandIns::default()))
    }

    /// Two threads ask for one key that has no member yet: one member is made and both
    /// get it. Fails without the second look under the lock (`keyed`).
    #[test]
    fn loom_two_threads_asking_for_one_key_get_one_member() {
        loom::model(|| {
            let r = router();
            let ask = || {
                let r = Arc::clone(&r);
                thread::spawn(move || r.member(1).unwrap() as *const StandIn as usize)
            };
            let (a, b) = (ask(), ask());
            let (a, b) = (a.join().unwrap(), b.join().unwrap());
            assert_eq!(a, b, "one member for the key");
            assert_eq!(r.route().made.load(Ordering::Relaxed), 1, "made once");
            assert_eq!(r.members().count(), 1);
        });
    }

    /// `update` (a new bound) beside the first use of a key: the member made is bounded,
    /// whichever comes first, and so is one made after both. Fails if `update` does not
    /// hold the lock members are made under (under it, the order of its two steps does
    /// not matter).
    #[test]
    fn loom_a_member_made_beside_an_update_sees_it() {
        loom::model(|| {
            let r = router();
            let maker = {
                let r = Arc::clone(&r);
                thread::spawn(move || {
                    r.member(1).unwrap();
                })
            };
            let updater = {
                let r = Arc::clone(&r);
                thread::spawn(move || {
                    r.update(
                        |route| route.bound.store(64, Ordering::Relaxed),
                        |m| *m.bound.lock().unwrap() = 64,
                    );
                })
            };
            maker.join().unwrap();
            updater.join().unwrap();
            let first = r.find(1).unwrap();
            assert_eq!(*first.bound.lock().unwrap(), 64, "the member made beside");
            let later = r.member(2).unwrap();
            assert_eq!(*later.bound.lock().unwrap(), 64, "a member made after");
        });
    }

    /// A member made on one thread, whose block another thread frees (it learns of the
    /// block through the program, here a flag) while a third thread uses the same member
    /// and makes another (the lists grow): each free finds the member by address; an
    /// address in no range finds none. Fails if a member is listed before its range is
    /// added (the third thread may find it and free a block the ranges do not know).
    #[test]
    fn loom_a_free_finds_the_member_made_on_another_thread() {
        loom::model(|| {
            let r = router();
            let allocated = Arc::new(AtomicBool::new(false));
            let allocator = {
                let (r, a) = (Arc::clone(&r), Arc::clone(&allocated));
                thread::spawn(move || {
                    r.member(1).unwrap();
                    a.store(true, Ordering::Release); // hands out 0x1800
                })
            };
            let other = {
                let r = Arc::clone(&r);
                thread::spawn(move || {
                    // Finds member 1 made by the allocator, or makes it: either way a
                    // block it hands out is found by its address at once.
                    r.member(1).unwrap();
                    assert_eq!(r.holding(0x1c00).map(|m| m.key), Some(1));
                    r.member(4).unwrap();
                })
            };
            let freer = {
                let (r, a) = (Arc::clone(&r), Arc::clone(&allocated));
                thread::spawn(move || {
                    if a.load(Ordering::Acquire) {
                        let m = r.holding(0x1800).expect("the free finds the member");
                        assert_eq!(m.key, 1);
                    }
                    assert!(r.holding(0x9000).is_none(), "in no member's range");
                })
            };
            allocator.join().unwrap();
            other.join().unwrap();
            freer.join().unwrap();
            assert_eq!(r.holding(0x1800).map(|m| m.key), Some(1));
            assert_eq!(r.holding(0x4800).map(|m| m.key), Some(4));
        });
    }
}
