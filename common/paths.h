// Default locations of the daemon's socket and state, shared by muond and its clients so that
// both agree without configuration.
//   socket: unix://$XDG_RUNTIME_DIR/muond/muond.sock, or unix:///run/muond/muond.sock as root
//           (or when XDG_RUNTIME_DIR is unset)
//   state:  /var/lib/muond as root, else $XDG_STATE_HOME/muond or $HOME/.local/state/muond
// Clients also honour $MUOND_ADDRESS. Thread-safe (reads the environment only).
#ifndef MUOND_COMMON_PATHS_H_
#define MUOND_COMMON_PATHS_H_

#include <string>

namespace muond::common {

std::string DefaultListenAddress();
std::string DefaultStateDir();
// The address a client uses when none is given: $MUOND_ADDRESS if set, else DefaultListenAddress().
std::string DefaultClientAddress();

}  // namespace muond::common

#endif  // MUOND_COMMON_PATHS_H_
