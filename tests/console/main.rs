//! The console in a real headless Chromium (Debian's `chromium`, driven by `chromedriver`
//! through WebDriver) against a live service loaded with a known month of events. Each test
//! has its own database, nats-server, chromedriver and browser profile, and leaves nothing
//! behind. Pages are read only through the console's DOM contract (`#page[data-page]`,
//! `data-ready`, `data-figure`/`data-value`, the ids and classes it names), and every figure
//! is compared with what the public API answers. Screenshots of each page go to
//! `target/console-screenshots/`.

#[allow(dead_code)]
#[path = "../api/helpers.rs"]
mod helpers;

mod browser;
mod month;

mod access;
mod finance;
mod large;
mod org;
