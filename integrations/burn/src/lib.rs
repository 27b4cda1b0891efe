//! kolo-burn
use burn as _;
