//! The caller's order of a group's members: groups are submitted sorted by name, so
//! that every rank negotiates and fuses them alike, and handed back in the order the
//! caller listed them. A leaf module (it imports nothing of kolo's), so that the
//! errors and the handles can both use it.

/// Puts `items`, in a group's sorted order, back into the caller's order (see
/// `Submission::order`); `None` means they already are.
pub(crate) fn unsort<T>(order: Option<&[u32]>, items: Vec<T>) -> Vec<T> {
    let Some(order) = order else {
        return items;
    };
    if order.len() != items.len() {
        return items;
    }
    let mut slots: Vec<Option<T>> = items.into_iter().map(Some).collect();
    order
        .iter()
        .filter_map(|&i| slots.get_mut(i as usize).and_then(Option::take))
        .collect()
}
