//! Rebuilds when a migration is added: `sqlx::migrate!` embeds the files of `migrations/`,
//! and without this cargo would not see a new file there.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
