//! A group's plan: its members sorted by name, the member keys and the group's key.
//! Every rank negotiates, checks and fuses a group's members in one order, whatever
//! order each rank listed them in; the plan of a list of names is kept, since a
//! training loop submits the same groups every step and sorting a thousand names,
//! quoting them into the group's key and allocating a key per member cost about a
//! quarter of such a call's own instructions (callgrind, 1000 members at np 1).

use std::collections::VecDeque;
use std::hash::Hasher;
use std::sync::{Arc, Mutex, PoisonError};

use crate::engine::request::{Key, Named, OpKind, Submission};
use crate::tensor::Tensor;

/// How many plans a [`Plans`] keeps (the most recently used): a loop's groups per
/// step (buckets, layers) rarely number more.
const KEPT: usize = 32;

/// The plans of the groups submitted last (most recent first).
#[derive(Default)]
pub(crate) struct Plans {
    kept: Mutex<VecDeque<Arc<Plan>>>,
}

impl std::fmt::Debug for Plans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plans").finish_non_exhaustive()
    }
}

/// The plan of one list of names, in the caller's order.
struct Plan {
    /// A hash of the names in the caller's order (a quick first comparison).
    hash: u64,
    /// The member keys, sorted.
    keys: Vec<Key>,
    /// Where each of the caller's members goes among the sorted (None: in place).
    order: Option<Box<[u32]>>,
    /// The group's negotiation key.
    key: Key,
}

impl Plan {
    /// The sorted position of the caller's member `i`.
    fn position(&self, i: usize) -> usize {
        self.order.as_ref().map_or(i, |o| o[i] as usize)
    }

    /// Whether this is the plan of `tensors`' names, in their order.
    fn fits(&self, hash: u64, tensors: &[(String, Tensor)]) -> bool {
        self.hash == hash
            && self.keys.len() == tensors.len()
            && tensors
                .iter()
                .enumerate()
                .all(|(i, (n, _))| *self.keys[self.position(i)] == **n)
    }
}

fn names_hash(tensors: &[(String, Tensor)]) -> u64 {
    let mut h = rustc_hash::FxHasher::default();
    for (n, _) in tensors {
        h.write(n.as_bytes());
        h.write_u8(0xff);
    }
    h.finish()
}

/// The submission of a group of `kind`: its members sorted by name (every rank the
/// same order) under their keys, keyed by their names, with the caller's order.
pub(crate) fn group(plans: &Plans, kind: OpKind, tensors: Vec<(String, Tensor)>) -> Submission {
    let hash = names_hash(&tensors);
    let found = {
        let mut kept = plans.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let at = kept.iter().position(|p| p.fits(hash, &tensors));
        at.and_then(|i| kept.remove(i))
            .inspect(|p| kept.push_front(Arc::clone(p)))
    };
    let plan = match found {
        Some(plan) => plan,
        None => {
            let plan = Arc::new(new_plan(hash, &tensors));
            let mut kept = plans.kept.lock().unwrap_or_else(PoisonError::into_inner);
            kept.push_front(Arc::clone(&plan));
            kept.truncate(KEPT);
            plan
        }
    };
    let mut slots: Vec<Option<Tensor>> = (0..tensors.len()).map(|_| None).collect();
    for (i, (_, t)) in tensors.into_iter().enumerate() {
        slots[plan.position(i)] = Some(t);
    }
    // `order` is a permutation of the positions, so every slot is filled.
    let members: Named = plan
        .keys
        .iter()
        .cloned()
        .zip(slots.into_iter().flatten())
        .collect();
    let mut s = Submission::new(kind, Arc::clone(&plan.key), members);
    s.order = plan.order.clone();
    s
}

/// The plan of `tensors`' names, made anew.
fn new_plan(hash: u64, tensors: &[(String, Tensor)]) -> Plan {
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    let (sorted, order) = sorted_names(&names);
    Plan {
        hash,
        key: Key::from(group_key(&sorted)),
        keys: sorted.iter().map(|&n| Key::from(n)).collect(),
        order,
    }
}

/// `names` sorted, and the caller's order where it differs (`order[i]`: where the
/// caller's name `i` went). Every rank then negotiates, checks and fuses the members
/// in one order, whatever order each rank listed them in (a list built from a
/// `HashMap` differs from process to process); the handle gives the results back in
/// the caller's order.
fn sorted_names<'a>(names: &[&'a str]) -> (Vec<&'a str>, Option<Box<[u32]>>) {
    if names.windows(2).all(|w| w[0] <= w[1]) {
        return (names.to_vec(), None);
    }
    let mut idx: Vec<usize> = (0..names.len()).collect();
    idx.sort_by(|&a, &b| names[a].cmp(names[b]));
    let mut order = vec![0u32; names.len()];
    for (sorted_pos, &caller) in idx.iter().enumerate() {
        // A group has far fewer than 2^32 members (each is a submitted tensor).
        order[caller] = u32::try_from(sorted_pos).unwrap_or(u32::MAX);
    }
    let sorted = idx.iter().map(|&i| names[i]).collect();
    (sorted, Some(order.into_boxed_slice()))
}

/// The negotiation key of a group: its member names (sorted, see [`sorted_names`]),
/// so that two different groups never collide and the same group matches on every rank.
fn group_key(names: &[&str]) -> String {
    use std::fmt::Write;
    // Quoted (Rust string syntax), so that names holding ", " or quotes cannot make two
    // different groups share a key; in kolo's reserved key space.
    let room: usize = names.iter().map(|n| n.len() + 4).sum();
    let mut key = String::with_capacity(room + 16);
    key.push(crate::engine::request::RESERVED_PREFIX);
    key.push_str("group[");
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            key.push_str(", ");
        }
        // A printable ASCII name without quotes or backslashes (nearly every one) is
        // quoted by hand: byte for byte what `{:?}` writes, without formatting.
        if n.bytes()
            .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
        {
            key.push('"');
            key.push_str(n);
            key.push('"');
        } else {
            // Writing into a String cannot fail.
            let _ = write!(key, "{n:?}");
        }
    }
    key.push(']');
    key
}

#[cfg(test)]
mod tests {
    use super::{group_key, names_hash, new_plan, Plan};
    use crate::Tensor;

    fn members(names: &[&str]) -> Vec<(String, Tensor)> {
        names
            .iter()
            .map(|n| (n.to_string(), Tensor::from_vec(vec![0f32], &[1]).unwrap()))
            .collect()
    }

    fn plan(names: &[&str]) -> Plan {
        let m = members(names);
        new_plan(names_hash(&m), &m)
    }

    /// The hand-quoted names and the escaped ones make the key `{:?}` would make.
    #[test]
    fn group_key_quotes_each_name_as_debug_does() {
        let names = [
            "w.0",
            "a, b",
            "say \"hi\"",
            "back\\slash",
            "tab\there",
            "é",
            "~ok ",
        ];
        let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
        let want = format!(
            "{}group[{}]",
            crate::engine::request::RESERVED_PREFIX,
            quoted.join(", ")
        );
        assert_eq!(group_key(&names), want);
    }

    /// A plan sorts the names, records where each of the caller's went, and fits
    /// exactly the same names in the same order.
    #[test]
    fn a_plan_fits_only_its_names_in_their_order() {
        let p = plan(&["b", "c", "a"]);
        let keys: Vec<&str> = p.keys.iter().map(|k| &**k).collect();
        assert_eq!(keys, ["a", "b", "c"]);
        assert_eq!(p.order.as_deref(), Some(&[1u32, 2, 0][..]));
        assert_eq!(&*p.key, &*plan(&["a", "b", "c"]).key);
        let same = members(&["b", "c", "a"]);
        assert!(p.fits(names_hash(&same), &same));
        for other in [
            &["a", "b", "c"][..],
            &["b", "c"],
            &["b", "c", "d"],
            &["b", "c", "a", "e"],
        ] {
            let m = members(other);
            assert!(
                !p.fits(names_hash(&m), &m),
                "{other:?} fits the plan of b, c, a"
            );
        }
        // Sorted already: no order to keep.
        assert!(plan(&["a", "b"]).order.is_none());
    }
}
