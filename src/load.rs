//! The loading step: every file a config names, read once before its snapshot is built
//! (see [`crate::config::files`], which lists them and holds their bytes), and the keys
//! file read into its key set. Building the snapshot from a [`Loaded`]
//! (`Snapshot::build`) then reads nothing.

use crate::config::files::{base_dir, named, wants_system_roots, KEYS_FILE};
use crate::config::{ConfigFile, Files};
use crate::identity::keys::{KeyErrors, KeySet, KeySource};
use crate::identity::Identities;
use std::sync::Arc;

/// What the loading step read for one config.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Every file the config names but the keys file, each its bytes or its read error.
    pub files: Files,
    /// The keys file (`identity.clients_file`) read into its key set; `None` without a
    /// keys file, or when the identities being replaced keep their set (see
    /// [`crate::identity::read_keys`]).
    pub keys: Option<Result<Arc<KeySet>, KeyErrors>>,
}

impl Loaded {
    /// The loading step of a whole config: every file [`named`] lists is read, in its
    /// order (the keys file last, into its key set), and the system's trusted roots when
    /// a key asks for them. `previous` are the identities of the snapshot the one to be
    /// built replaces: when they keep their key set (same keys file and names), the keys
    /// file is not read. Build with the same previous snapshot.
    pub fn load(file: &ConfigFile, previous: Option<&Identities>) -> Loaded {
        let cfg = &file.config;
        let mut files = Files::read(named(file).into_iter().filter(|n| n.key != KEYS_FILE));
        if wants_system_roots(cfg) {
            files = files.with_system_roots();
        }
        let source = KeySource::of_config(cfg, &base_dir(&file.path));
        Loaded {
            files,
            keys: crate::identity::read_keys(&source, previous),
        }
    }
}
